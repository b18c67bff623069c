#!/usr/bin/env python
"""Data-parallel and FSDP scaling of jaxft's LoRA step on 1-N devices of one host, beside HF+PEFT under accelerate
(issue #15's scaling table).

    python -m experiments.probes.bench_scaling --workload 8b_4096 --devices 1,2,4,8 --meshes dp,fsdp \\
        --systems jaxft,hf_ckpt --steps 10 --json scaling.json --md scaling.md

Each jaxft point (mesh, device count N) runs in a process of its own on the first N devices (CUDA_VISIBLE_DEVICES, so
no process holds memory on a GPU it does not use and each point's allocator peak is its own). It runs the recipe
`examples/bench/<mode>.yaml` (`--mode`, default fast: what `jaxft-train` runs) through `jaxft.run.Run` with the
recipe's `mesh` set to `{data: N}` ("dp": weights replicated, rows split) or `{data: 1, fsdp: N}` ("fsdp": frozen
weights split across the devices too), on random weights of the workload's model shape (`Run.init_random`: no
checkpoint on disk). Every device trains the workload's rows (`bench.workloads`: 1 x 4096 for 8b_4096), so the
global batch grows with N (weak scaling).

Timing: one untimed step (warm-up; the step was compiled before the weights were made), then `--steps` steps,
each synchronised on its loss (the clock is read after the device finished); as in `jaxft-train`, each step's
input rows are placed from the host inside it (kilobytes per device). tokens/s per device = the step's tokens /
the median step time / N; efficiency = that over the one-device point's (one device is the same program for
every mesh, so it runs once). Peak memory per device: the allocator's `peak_bytes_in_use` of each device after
the steps (not reported on a CPU; the random init before them keeps no temporaries on a GPU, so the peak is the
steps': `Run.random_state_program`), beside the compiled step's estimate (`jaxft.memory.budget.peak_estimate`, what
experiments/probes/memory_table.py tabulates and `mesh: auto` plans with). Same data at every mesh of one N: the first
losses of dp and fsdp agree (a check that both train the same thing).

HF+PEFT points (`--systems hf_ckpt,hf_nockpt`: gradient checkpointing on / off) run
experiments/probes/bench_scaling_hf.py on the same first N devices, one process per device under torchrun (one device: a
plain process), with accelerate's DDP ("dp") or FSDP2 ("fsdp"): the same workload rows per device, the same LoRA
targets, rank and optimizer as scripts.bench.torch_worker's; see that module for how it is timed. Efficiency is each
system's own: over its one-device row.

The 70B-shaped FSDP point is `--workload 70b_4096 --devices 8 --meshes fsdp --systems jaxft`: `Run.init_random`
makes the weights in place, each device drawing only its shards.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


from scripts.bench.report import heading  # noqa: E402
from scripts.bench.worker_common import is_oom_message  # noqa: E402
from experiments.probes.bench_scaling_hf import SYSTEMS as HF_SYSTEMS  # noqa: E402
from experiments.probes.memory_table import MESHES, mesh_of  # noqa: E402 - the memory table's dp / fsdp meshes

GIB = 2**30
SYSTEMS = ("jaxft",) + HF_SYSTEMS
HF_WORKER = "experiments.probes.bench_scaling_hf"  # a module: run with -m (torchrun too)
# Kept off in every child, as the multi-GPU machines require: NVLink multicast can take a host's GPUs out of service.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def run_point(workload_name: str, mesh: str, devices: int, steps: int, mode: str) -> dict:
    """One point, in this process, on its first `devices` devices: the row of the table (see the docstring)."""
    import jax
    import numpy as np

    from scripts.bench.workloads import SHAPES, get_workload, make_token_data
    from scripts.bench.jaxft_worker import mode_config, run_dtype
    from jaxft.memory import peak_estimate
    from jaxft.run import Run

    if devices > jax.device_count():
        raise SystemExit(f"bench_scaling: {devices} devices asked for, {jax.device_count()} visible")
    workload = get_workload(workload_name)
    axes = mesh_of(mesh, devices)
    # Every device trains the workload's rows: the global batch is N times the workload's.
    data = make_token_data(dataclasses.replace(workload, batch=workload.batch * devices), steps + 1)
    batches = [data.step(i) for i in range(steps + 1)]
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(SHAPES[workload.shape_name].config_dict()))
        mesh_override = "mesh={" + ", ".join(f"{k}: {v}" for k, v in axes.items()) + "}"
        config = mode_config(mode, model_dir, workload, run_dtype(workload), extra=(mesh_override,))
        run = Run.from_config(config, total_steps=steps + 1, devices=jax.devices()[:devices])
        run.compile(batches[0])  # before the weights exist, as the harness does (scripts.bench.jaxft_worker)
        compile_s = run.compile_seconds
        estimate = peak_estimate(run.memory_analysis())  # what memory_table.py and `mesh: auto` plan with
        run.init_random()
    times, losses = [], []
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        losses.append(float(jax.block_until_ready(run.step(batch, i)["loss"])))
        if i:  # step 0 is the warm-up
            times.append(time.perf_counter() - t0)
    stats = [d.memory_stats() or {} for d in jax.devices()[:devices]]
    peaks = [round(s["peak_bytes_in_use"] / GIB, 3) for s in stats if "peak_bytes_in_use" in s]
    tokens = int(np.size(batches[0]["input_ids"]))
    step_s = statistics.median(times)
    return {"system": "jaxft", "mesh": mesh, "devices": devices, "mode": mode, "workload": workload_name,
            "mesh_shape": {k: int(v) for k, v in run.placement.mesh.shape.items()}, "tokens_per_step": tokens,
            "step_s": step_s, "step_times_s": times, "tokens_per_s": tokens / step_s,
            "tokens_per_s_per_device": tokens / step_s / devices, "peak_gib_per_device": peaks or None,
            "estimate_gib_per_device": round(estimate / GIB, 3),
            "losses": losses, "compile_s": round(compile_s, 1), "device_kind": jax.devices()[0].device_kind}


_CHILDREN: set[subprocess.Popen] = set()


def _stop_children(signum, frame):
    """SIGTERM / SIGINT (e.g. `timeout` around this script): the running point's process group goes too, since a
    child in a session of its own would outlive this process and hold its GPUs."""
    for child in list(_CHILDREN):
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    raise SystemExit(128 + signum)


def point_command(args, system: str, mesh: str, devices: int, out: Path) -> list[str]:
    """The child process of a point: jaxft's `run_point` (this script with --point), or the HF+PEFT worker, under
    torchrun with a process per device when there are several."""
    common = ["--workload", args.workload, "--steps", str(args.steps), "--json", str(out)]
    if system == "jaxft":
        return [sys.executable, "-m", "experiments.probes.bench_scaling", "--point", f"{mesh}:{devices}",
                "--mode", args.mode, *common]
    launch = [sys.executable] if devices == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(devices)]
    return [*launch, "-m", HF_WORKER, "--system", system, "--mesh", mesh, *common]


# torch.distributed's launcher and store errors: a point that failed with one of these before any worker said why,
# or after the workers wrote the row, failed in torchrun's rendezvous (its port, its shutdown), not in the training.
LAUNCHER_ERRORS = ("RendezvousConnectionError", "RendezvousClosedError", "DistNetworkError", "DistStoreError",
                   "Address already in use")


def _point_in_a_process(args, system: str, mesh: str, devices: int, once=None) -> dict:
    """A point in a child process on the first `devices` GPUs (CUDA_VISIBLE_DEVICES; on a CPU a jaxft child sees the
    parent's devices, e.g. XLA_FLAGS=--xla_force_host_platform_device_count=8, and torchrun starts CPU processes).

    A launcher failure before the workers began (`LAUNCHER_ERRORS`, no worker's own line) runs the point once more;
    the row keeps the first try's error as `retried_after`. A row the workers wrote (every rank had finished its
    steps: the HF worker gathers them before rank 0 writes) stays a measurement when the launcher then exits non-zero
    in its shutdown; its last line goes in `launcher_exit`."""
    once = once or _point_once  # tests pass their own child
    row = once(args, system, mesh, devices)
    if row.pop("launcher_failed", False):
        row = {**once(args, system, mesh, devices), "retried_after": row["error"]}
        row.pop("launcher_failed", None)
    return row


def _point_once(args, system: str, mesh: str, devices: int) -> dict:
    env = {**os.environ, **NO_MULTICAST}
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(devices)]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:devices])
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "point.json"
        began = time.perf_counter()
        # Its own process group: a point past --timeout is killed whole (torchrun's workers hold GPUs too), and so
        # is the running point when this process is told to stop (`_stop_children`).
        child = subprocess.Popen(point_command(args, system, mesh, devices, out), env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
        _CHILDREN.add(child)
        timed_out = False
        try:
            stdout, stderr = child.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            stdout, stderr = child.communicate()
            timed_out = True
        finally:
            _CHILDREN.discard(child)
        if timed_out:
            return {"system": system, "mesh": mesh, "devices": devices, "status": "timeout",
                    "error": f"over --timeout {args.timeout:g} s", "wall_s": round(time.perf_counter() - began, 1)}
        wall = {"wall_s": round(time.perf_counter() - began, 1)}  # the whole child: start-up, compile, init, steps
        written = json.loads(out.read_text()) if out.exists() else None
        return point_row(system, mesh, devices, child.returncode, stdout, stderr, written, wall)


def point_row(system: str, mesh: str, devices: int, returncode: int, stdout: str, stderr: str,
              written: dict | None, wall: dict) -> dict:
    """A finished child's row: what it wrote (ok, with `launcher_exit` when the launcher then exited non-zero), else
    an error naming the worker's own refusal line or the output's last lines; `launcher_failed` marks a failure of
    torchrun's rendezvous before any worker spoke (`LAUNCHER_ERRORS`), which `_point_in_a_process` tries again."""
    lines = (stdout + stderr).strip().splitlines()
    if written is not None:
        row = {**written, "status": "ok", **wall}
        if returncode:
            row["launcher_exit"] = f"exit {returncode}: " + (lines[-1] if lines else "no output")
        return row
    # A worker's own one-line refusal (its rank 0 prints it) says more than torchrun's summary.
    own = [line for line in lines if line.startswith(("bench_scaling:", "bench_scaling_hf:"))]
    status = "oom" if is_oom_message(stderr) else "error"
    launcher = not own and status == "error" and any(e in stderr for e in LAUNCHER_ERRORS)
    return {"system": system, "mesh": mesh, "devices": devices, "status": status,
            "error": own[0] if own else " | ".join(lines[-3:]), **wall, "launcher_failed": launcher}


def add_efficiency(rows: list[dict]) -> list[dict]:
    """Each ok row's `efficiency`: its tokens/s per device over its system's one-device row's (None without it)."""
    base = {r["system"]: r for r in rows if r["devices"] == 1 and r.get("status") == "ok"}
    for r in rows:
        if r.get("status") == "ok":
            one = base.get(r["system"])
            r["efficiency"] = r["tokens_per_s_per_device"] / one["tokens_per_s_per_device"] if one else None
    return rows


def markdown(rows: list[dict], argv: list[str]) -> str:
    kind = next((r["device_kind"] for r in rows if r.get("status") == "ok"), "?")
    lines = [heading("-m experiments.probes.bench_scaling", argv, kind), "",
             "| system | mesh | devices | step | tokens/s | tokens/s per device | efficiency | peak per device | "
             "estimate | first loss |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['system']} | {r['mesh']} | {r['devices']} | {r['status']}: {r.get('error', '')} "
                         "| | | | | | |")
            continue
        peak = f"{max(r['peak_gib_per_device']):.2f} GiB" if r["peak_gib_per_device"] else "n/a (CPU)"
        eff = f"{100 * r['efficiency']:.1f}%" if r.get("efficiency") is not None else "-"
        estimate = f"{r['estimate_gib_per_device']:.2f} GiB" if r.get("estimate_gib_per_device") else "-"
        lines.append(f"| {r['system']} | {r['mesh']} | {r['devices']} | {1000 * r['step_s']:.1f} ms | "
                     f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_device']:,.0f} | {eff} | {peak} | {estimate} | "
                     f"{r['losses'][0]:.4f} |")
    # What the launcher did around a point's row (`_point_in_a_process`), so a table never hides a second try.
    notes = [f"- {r['system']} {r['mesh']} {r['devices']}: {what} {r[key]}" for r in rows
             for key, what in (("retried_after", "ran twice; the first try failed in torchrun's rendezvous:"),
                               ("launcher_exit", "the launcher failed after the row was written:")) if r.get(key)]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="8b_4096", help="a scripts/bench/workloads.py workload (rows per device)")
    p.add_argument("--devices", default="1,2,4,8")
    p.add_argument("--meshes", default="dp,fsdp", help=f"comma list of {', '.join(MESHES)}")
    p.add_argument("--systems", default="jaxft,hf_ckpt", help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--steps", type=int, default=10, help="timed steps per point, after one untimed")
    p.add_argument("--mode", default="fast", help="the recipe examples/bench/<mode>.yaml")
    p.add_argument("--timeout", type=float, default=900, help="seconds per point")
    p.add_argument("--json", default=None, help="write the rows here (rewritten after every point)")
    p.add_argument("--md", default=None, help="write the markdown table here")
    p.add_argument("--point", default=None, help=argparse.SUPPRESS)  # MESH:N, run in this process (the children)
    args = p.parse_args(argv)
    if args.point:
        mesh, n = args.point.split(":")
        Path(args.json).write_text(json.dumps(run_point(args.workload, mesh, int(n), args.steps, args.mode)))
        return 0
    meshes = args.meshes.split(",")
    for m in meshes:
        if m not in MESHES:
            raise SystemExit(f"bench_scaling: --meshes {m!r}: use {', '.join(MESHES)}")
    systems = args.systems.split(",")
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"bench_scaling: --systems {s!r}: use {', '.join(SYSTEMS)}")
    if args.steps < 1:
        raise SystemExit("bench_scaling: --steps must be >= 1")
    signal.signal(signal.SIGTERM, _stop_children)
    signal.signal(signal.SIGINT, _stop_children)
    rows = []
    points = [(n, system, mesh) for n in sorted({int(x) for x in args.devices.split(",")}) for system in systems
              for mesh in (meshes[:1] if n == 1 else meshes)]  # one device: every mesh is the same program
    for n, system, mesh in points:
        rows.append(_point_in_a_process(args, system, mesh, n))
        r = rows[-1]
        print(f"[scaling] {system} {mesh} x {n}: " + (f"{r['tokens_per_s_per_device']:,.0f} tokens/s per device"
                                                      if r["status"] == "ok" else f"{r['status']}: {r['error']}"),
              flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(add_efficiency(rows), indent=1))
    text = markdown(add_efficiency(rows), argv or sys.argv[1:])
    if args.md:
        Path(args.md).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
