#!/usr/bin/env python
"""Max context: the longest single row (batch 1) each remat policy can train on this device, from the compiled
step's memory analysis plus host-memory accounting, then one real step at the goal length.

    python -m experiments.probes.max_context [--model llama-3.1-8b] [--policies none,full,...]
        [--host-memory-gb 128] [--device-memory-gb G] [--deadline-s 300] [--out max_context.jsonl] [--md t.md]

The step is the benchmark's (`examples/bench/auto.yaml`: LoRA r16 alpha 32 on q..down, AdamW; bf16; attention
"auto") run through `jaxft.run.Run`, with remat set to the policy, the layer loop as `layer_loop: auto` picks it
(the scan under remat, unrolled without), the cross-entropy chunk by length (`ExecutionConfig.resolved_ce_chunk`)
and, for rows longer than `--mlp-chunk-size` (8192), the MLP in chunks of that many tokens (`mlp_chunk_size`: one
layer never holds [T, intermediate] activations). A length T fits when

    device: arguments + outputs + temporaries - aliased + allocator slack (`jaxft.memory.budget.peak_estimate` of
            `Run.compile` from shapes,
            before any weight exists) <= the device budget (free memory less max(1 GiB, 5%), or --device-memory-gb)
    host:   the offloaded residuals (`jaxft.memory.policy.residual_bytes` of the policy's offloaded names x layers, or
    what
            the compiled program reports in host memory if more) <= the host budget (--host-memory-gb, default the
            machine's memory, less max(8 GiB, 10%) for the process itself).

Search (`search_max`): both sides grow with T, so the fitting lengths are a prefix. The first probe is an analytic
guess (weights + the policy's per-token residuals from `residual_bytes`), then secant steps on the compiled
estimate (it is close to affine in T), clamped inside the bracket (largest fitting, smallest failing length),
until the bracket is one granule (--granularity, 1024) wide, the probe count is spent or the deadline is near.
Each probe is one compile (no weights, no run), with XLA's autotuning off on the GPU (--probe-autotune-level 0:
a long-row compile otherwise times every GEMM at full size); the real step compiles with autotuning.
Policies run in parallel worker processes (--jobs), one compile each at a time.

`offload_nested` is remat offload in nested blocks sized to the host budget (`remat_block: auto`, jaxft.memory.policy):
the host holds one layer input per block, so its row is limited by the device (k layer inputs and one block's
recompute). Its load falls where a longer row takes a larger block, hence the search's frontier secant.

`--deviceless` compiles every probe for the H200 target description on a machine without a GPU
(experiments/deviceless/gpu_compile.py): no real step, no autotuning, Pallas attention (cuDNN does not lower there).
Measured against the GPU's own search (docs/benchmarks.md section 29) it gives 9-17% longer rows for the
device-limited policies: a planning number, not a measurement.

`auto` is not searched: it takes the first of `jaxft.memory.policy.AUTO_ORDER` that fits the device and the host
(`jaxft.memory.choice.host_fit`), and runs offload in nested blocks where offload's layer inputs exceed the host, so its
longest row is the longest of its candidates' (offload's: the longer of `offload` and `offload_nested`), and the
row says which candidate it would choose there (`auto_row`).

The real step (`--step-policy`, default offload, at `--step-seq`, default 262144, in its own process, started
beside the searches so the call ends in time): random weights made on the device (`Run.init_random`), one
forward + backward + AdamW update; step time, the allocator's peak, the process's peak RSS (pinned host buffers
included). `--step-seq max` waits for the searches and steps at the step policy's longest row instead.

Unsloth runs in torch, so its longest row cannot come from this method. Its column is DERIVED, not measured:
a least-squares line through its measured peaks (issue #10, H200, commit aa868ab: 19.72 / 23.9 / 32.3 GiB at
16k / 32k / 64k tokens, about 0.26 GiB per 1k tokens), solved for the device budget.

The pieces live in experiments/probes/maxctx/ (search.py: the search; probes.py: the step, one probe, a policy's search
and the real step; table.py: the derived rows and the table), re-exported here; this script runs them (worker processes,
the deadline).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from experiments.probes.maxctx.probes import (GIB, POLICIES, RECIPE, REMAT_OF, ROOT, Settings,
                                              analytic_device_per_token, argument_bytes, device_budget, execution_for,
                                              host_bytes_analytic, make_batch, make_run, probe, real_step, recipe,
                                              search_policy)
from experiments.probes.maxctx.search import SearchResult, search_max
from experiments.probes.maxctx.table import (UNSLOTH_POINTS, auto_row, from_probes, markdown, parse_points,
                                             unsloth_derived)


__all__ = [
    "ROOT", "GIB", "POLICIES", "REMAT_OF", "RECIPE", "UNSLOTH_POINTS", "SearchResult", "search_max", "Settings",
    "recipe", "execution_for", "make_run", "make_batch", "host_bytes_analytic", "argument_bytes",
    "analytic_device_per_token", "device_budget", "probe", "search_policy", "real_step", "unsloth_derived",
    "auto_row", "parse_points", "markdown", "from_probes", "model_dir", "parse_args", "worker", "Collector", "main",
]


# ------------------------------------------------------------------------------------------- driver
def model_dir(model: str, layers: int | None, workdir: str) -> str:
    """A directory with the config.json of `model` (a shape of scripts/bench/workloads.py SHAPES or a
    directory), with `layers` layers if given."""
    if os.path.isdir(model):
        config = json.loads((Path(model) / "config.json").read_text())
    else:
        from scripts.bench.workloads import SHAPES

        if model not in SHAPES:
            raise SystemExit(f"--model {model!r}: not a directory and not a shape of scripts/bench/workloads.py "
                             f"(shapes: {', '.join(SHAPES)})")
        config = SHAPES[model].config_dict()
    if layers is not None:
        config["num_hidden_layers"] = layers
    if os.path.isdir(model) and layers is None:
        return model
    (Path(workdir) / "config.json").write_text(json.dumps(config))
    return workdir


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="a shape of scripts/bench/workloads.py, or a directory "
                    "with a config.json")
    ap.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--granularity", type=int, default=1024)
    ap.add_argument("--t-min", type=int, default=None, help="shortest row searched (default: one granule)")
    ap.add_argument("--t-max", type=int, default=1 << 20)
    ap.add_argument("--max-probes", type=int, default=8, help="compiles per policy at most")
    ap.add_argument("--device-memory-gb", type=float, default=None,
                    help="device budget in GiB (default: the device's free memory less max(1 GiB, 5%%))")
    ap.add_argument("--host-memory-gb", type=float, default=None,
                    help="host memory in GiB (default: the machine's); the budget is that less max(8 GiB, 10%%)")
    ap.add_argument("--mlp-chunk-size", type=int, default=8192, help="tile the MLP of rows longer than this (0: off)")
    ap.add_argument("--probe-autotune-level", type=int, default=None,
                    help="xla_gpu_autotune_level of the probes (default: 0 on a GPU, not set elsewhere)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--recipe", default=str(RECIPE), help="the YAML the step takes its LoRA, optimiser and base "
                    "from (default examples/bench/auto.yaml; examples/bench/qlora.yaml: the 4-bit base of QLoRA, "
                    "quantised from shapes, so no real step: --step-seq 0)")
    ap.add_argument("--unsloth-points", default=None, help="Unsloth's measured peaks for its derived row, "
                    "'TOKENS:GIB,...' (default: its bf16 LoRA peaks at 16k/32k/64k, issue #10)")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--deadline-s", type=float, default=300.0, help="the whole run ends within this many seconds")
    ap.add_argument("--jobs", type=int, default=None,
                    help="policies searched at once, each in its own process (0: in this process, one after "
                         "another; default: min(policies, cpus / 3) on a GPU, 0 elsewhere)")
    ap.add_argument("--step-policy", default="offload")
    ap.add_argument("--step-seq", default="262144", help="tokens of the real step; 'max': the step policy's longest "
                    "row (after the searches); 0: no step")
    ap.add_argument("--deviceless", action="store_true", help="compile for an H200 on this machine instead of "
                    "using its device (experiments/deviceless/gpu_compile.py; needs JAX_CUDA_PLUGIN_DIR, "
                    "--device-memory-gb and --step-seq 0; attention 'auto' becomes 'pallas', no autotuning)")
    ap.add_argument("--out", default=None, help="JSON lines (every probe, result and the step)")
    ap.add_argument("--md", default=None, help="the markdown table")
    ap.add_argument("--worker", choices=("search", "step"), help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    ap.add_argument("--deadline-at", type=float, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _print(rec: dict) -> None:
    print(json.dumps(rec), flush=True)


def _deviceless() -> None:
    """Sets up the compile for the H200 target (before JAX is first imported: the CUDA plugin's start-up check)."""
    import experiments.deviceless.gpu_compile  # noqa: F401  (its import sets the plugin up)


def _resolve(settings: Settings) -> Settings:
    """Settings as the worker's backend needs them: probes compile without autotuning on a GPU (and for one) by
    default."""
    import jax

    if settings.probe_autotune_level is None and (settings.deviceless or jax.default_backend() == "gpu"):
        return dataclasses.replace(settings, probe_autotune_level=0)
    return settings


def worker(args) -> int:
    settings = Settings(**json.loads(args.settings))
    if settings.deviceless:
        _deviceless()
    settings = _resolve(settings)
    if args.worker == "search":
        search_policy(settings, args.policy, deadline=args.deadline_at, emit=_print)
    else:
        real_step(settings, args.policy, args.seq, emit=_print)
    return 0


class Collector:
    """Every record of every worker, written to stdout and --out as it arrives (threads share it)."""

    def __init__(self, path: str | None):
        self.lock = threading.Lock()
        self.records: list[dict] = []
        self.file = open(path, "w") if path else None

    def __call__(self, rec: dict) -> None:
        with self.lock:
            self.records.append(rec)
            line = json.dumps(rec)
            print(line, flush=True)
            if self.file:
                self.file.write(line + "\n")
                self.file.flush()


def _spawn(args, settings: Settings, kind: str, policy: str, seq: int | None, deadline_at: float,
           collect: Collector, tag: dict) -> None:
    """Runs one worker process, forwarding its JSON lines; killed (this process's own child) past the deadline."""
    cmd = [sys.executable, "-m", "experiments.probes.max_context", "--worker", kind, "--policy", policy,
           "--settings", json.dumps(dataclasses.asdict(settings)), "--deadline-at", str(deadline_at)]
    if seq is not None:
        cmd += ["--seq", str(seq)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    timer = threading.Timer(max(deadline_at - time.time(), 1.0), proc.kill)
    timer.start()
    err_tail: list[str] = []
    drain = threading.Thread(target=lambda: err_tail.extend(proc.stderr.readlines()[-20:]), daemon=True)
    drain.start()
    for line in proc.stdout:
        if line.startswith("{"):
            collect(dict(json.loads(line), **tag))
    proc.wait()
    timer.cancel()
    drain.join(timeout=5)
    if proc.returncode != 0:
        collect(dict(event="worker_exit", kind=kind, policy=policy, returncode=proc.returncode,
                     killed_at_deadline=proc.returncode == -9, stderr_tail="".join(err_tail)[-1500:], **tag))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    began = time.time()
    deadline = began + args.deadline_s
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise SystemExit(f"--policies: {bad[0]!r} is not one of {', '.join(POLICIES)} (auto is derived from them)")
    points = parse_points(args.unsloth_points)
    if args.deviceless:
        if args.device_memory_gb is None or args.step_seq != "0":
            raise SystemExit("--deviceless: pass --device-memory-gb (there is no device to ask) and --step-seq 0 "
                             "(nothing can run)")
        _deviceless()
        if args.attention == "auto":  # cuDNN does not lower without cuDNN installed; the flash kernel does
            args.attention = "pallas"
    from jaxft.memory.policy import default_host_budget

    host_budget = default_host_budget(int(args.host_memory_gb * GIB) if args.host_memory_gb else None)
    if host_budget <= 0:
        raise SystemExit(f"--host-memory-gb {args.host_memory_gb}: nothing left after the 8 GiB margin; pass more")
    workdir = tempfile.mkdtemp(prefix="max_context_")
    settings = Settings(model_dir=model_dir(args.model, args.layers, workdir), granularity=args.granularity,
                        t_min=args.t_min or args.granularity, t_max=args.t_max,
                        device_budget=None if args.device_memory_gb is None else int(args.device_memory_gb * GIB),
                        host_budget=host_budget, mlp_chunk_size=args.mlp_chunk_size,
                        probe_autotune_level=args.probe_autotune_level, max_probes=args.max_probes,
                        dtype=args.dtype, attention=args.attention, recipe=args.recipe, deviceless=args.deviceless)
    if args.step_seq != "0" and recipe(settings).quant_config is not None:
        raise SystemExit(f"--recipe {args.recipe}: a 4-bit base has no random-weight step (Run.init_random makes "
                         "no 4-bit codes); pass --step-seq 0 (the search compiles from shapes and needs none)")
    collect = Collector(args.out)
    collect(dict(event="start", model=args.model, layers=args.layers, policies=policies, settings=dataclasses.asdict(settings),
                 deadline_s=args.deadline_s, step_policy=args.step_policy, step_seq=args.step_seq))
    step_seq = None if args.step_seq in ("0", "max") else int(args.step_seq)
    jobs = args.jobs
    if jobs is None:
        gpu = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True,
                             text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")).stdout.strip().endswith("gpu")
        jobs = min(len(policies), max(1, (os.cpu_count() or 3) // 3)) if gpu else 0
    results: dict[str, dict] = {}
    if jobs == 0:  # in this process, one after another
        local = _resolve(settings)
        for p in policies:
            results[p] = search_policy(local, p, deadline=deadline, emit=collect)
        if args.step_seq == "max" and results.get(args.step_policy, {}).get("max_seq"):
            step_seq = results[args.step_policy]["max_seq"]
        step = real_step(local, args.step_policy, step_seq, emit=collect) if step_seq else None
    else:
        threads = []
        if step_seq:  # beside the searches: its compile and step are most of the call's time
            threads.append(threading.Thread(target=_spawn, args=(args, settings, "step", args.step_policy, step_seq,
                                                                 deadline, collect, {})))
        pending = list(policies)
        lock = threading.Lock()

        def searcher():
            while True:
                with lock:
                    if not pending:
                        return
                    p = pending.pop(0)
                _spawn(args, settings, "search", p, None, deadline - 5, collect, {})

        threads += [threading.Thread(target=searcher) for _ in range(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for p in policies:
            done = [r for r in collect.records if r.get("event") == "result" and r.get("policy") == p]
            probes = [r for r in collect.records if r.get("event") == "probe" and r.get("policy") == p]
            results[p] = done[-1] if done else from_probes(p, probes, "killed at the deadline")
        step = None
        if args.step_seq == "max" and results.get(args.step_policy, {}).get("max_seq"):
            _spawn(args, settings, "step", args.step_policy, results[args.step_policy]["max_seq"],
                   began + args.deadline_s + 600, collect, {})
        steps = [r for r in collect.records if r.get("event") == "step"]
        step = steps[-1] if steps else ({"policy": args.step_policy, "seq": step_seq, "ok": False,
                                         "error": "killed at the deadline (or the worker died: see worker_exit)"}
                                        if step_seq or args.step_seq == "max" else None)
    budget = next((r.get("device_budget") for r in results.values() if r.get("device_budget")), None)
    auto = auto_row(results)
    summary = dict(event="summary", results=results, auto=auto, step=step, device_budget=budget,
                   host_budget=host_budget, unsloth_points=points,
                   unsloth_derived=unsloth_derived(budget, points) if budget else None,
                   wall_s=round(time.time() - began, 1))
    collect(summary)
    text = markdown(results, step, budget, host_budget, points)
    print(text)
    if args.md:
        Path(args.md).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
