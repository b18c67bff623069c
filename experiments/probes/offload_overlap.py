#!/usr/bin/env python
"""Do the host offload's copies overlap compute? A profile of a few real training steps per variant, read back.

    python -m experiments.probes.offload_overlap [--variants full:scan,offload:policy:scan,...]
        [--layers 4] [--seq 8192] [--steps 3] --out overlap.json [--trace overlap_trace.json.gz]

Each variant (remat policy : offload transfer : layer loop [: frozen weights device|host]) runs in its own process:
the benchmark's 8B shape (scripts/bench/workloads.py) cut to `--layers` layers, one row of `--seq` tokens, the
benchmark recipe's LoRA and AdamW through `jaxft.run.Run` on random weights (`Run.init_random`); two warm-up steps,
`--steps` steps timed without the profiler (`step_ms_unprofiled`, the median), then `--steps` steps under
`jax.profiler.trace`, each step inside a `TraceAnnotation` named `overlap_step_<i>` and waited for, so the device
events of step i are those inside that annotation's time span. CUDA-graph command buffers are turned off
(`--xla_gpu_enable_command_buffer=`) so every kernel names the HLO instruction it ran, unless
`--keep-command-buffers` (the step's own program options still turn them off for a policy that offloads in the layer
scan and for streamed weights, as in training). `OFFLOAD_OVERLAP_HLO_DIR` keeps each variant's optimized HLO there.

What JAX 0.11 writes: `DIR/plugins/profile/<run>/<host>.xplane.pb` and `<host>.trace.json.gz` (Chrome trace
format). In the JSON a GPU is a process named `/device:GPU:<n>`; its threads are the CUDA streams (`Stream #<id>
(...)`) plus lines derived from them (`XLA Ops`, `XLA Modules`, `Steps`, name scopes ...) that repeat the same time
spans: only the stream lines are counted. A kernel event's `args.hlo_op` names the HLO instruction; the optimized
HLO text (`compiled.as_text()`) gives that instruction's `op_name`, and ops under JAX's `transpose(` name stack are
the backward pass (the layers': the loss's scope `cross_entropy` and the optimizer's are left out). A copy between host and device is a memcpy event whose name or arguments say the direction
(D2H / H2D; device-to-device copies are neither host copies nor compute).

Per step (`analyse_trace`, averaged over the profiled steps, ms): d2h, h2d and their union `copy`; `compute` (union
of kernels); `backward` (union of backward kernels) and its per-layer share; `overlap` = copy and compute at
once = copy + compute - union; `hidden_fraction` = overlap / copy (1: every copy ran under compute, 0: serialised);
`sum` (copy + compute: the serialised bound), `union` (device busy), `max` (the perfectly overlapped bound); the
streams the copies and the kernels ran on and `copies_on_own_streams` (share of copy time on streams that ran no
kernel in the step). The JSON summary is small; `--trace` keeps the stream events of each variant's last step
(a few MB at most) for a trace viewer.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

STEP_MARKER = "overlap_step_"
DEFAULT_VARIANTS = ("full:policy:scan", "offload:policy:scan", "offload:explicit:unroll")
_STREAM = re.compile(r"^Stream #(\d+)")
_D2H = re.compile(r"d2h|dtoh|device\s*to\s*host|devicetohost", re.I)
_H2D = re.compile(r"h2d|htod|host\s*to\s*device|hosttodevice", re.I)
_SIZE = re.compile(r"(?:size|bytes)\D{0,3}(\d+)", re.I)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name=\"([^\"]*)\"")


# ------------------------------------------------------------------------------------------- the parser
def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its `op_name` metadata (the JAX name stack) in an optimized module's text."""
    names = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m:
            names[m.group(1)] = m.group(2)
    return names


def _lines(events):
    """(device pids, {(pid, tid): thread name})."""
    pids, names = set(), {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name" and "/device:gpu" in str(e.get("args", {}).get("name", "")).lower():
            pids.add(e["pid"])
        elif e.get("name") == "thread_name":
            names[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    return pids, names


def copy_direction(e: dict) -> str | None:
    """"d2h", "h2d" or "d2d" for a memcpy event (its name or arguments say which), None for a kernel."""
    text = f"{e.get('name', '')} {json.dumps(e.get('args', {}))}"
    if not re.search(r"memcpy", text, re.I):
        return None
    if _D2H.search(text):
        return "d2h"
    if _H2D.search(text):
        return "h2d"
    return "d2d"


def layer_backward(op_name: str) -> bool:
    """Whether an HLO op of this name stack is the layers' backward: under JAX's `transpose(`, outside the
    loss (scope cross_entropy: its backward is the lm_head's, not a layer's) and the optimizer."""
    return "transpose(" in op_name and "cross_entropy" not in op_name and "optimizer" not in op_name


def analyse_trace(trace: dict[str, Any], hlo_text: str, num_layers: int, marker: str = STEP_MARKER) -> dict[str, Any]:
    """The per-step overlap figures of the module docstring from a Chrome-format trace and the step's HLO."""
    events = trace.get("traceEvents", [])
    pids, thread = _lines(events)
    streams = {key: name for key, name in thread.items() if key[0] in pids and _STREAM.match(name)}
    windows = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
                     if e.get("ph") == "X" and str(e.get("name", "")).startswith(marker))
    out: dict[str, Any] = dict(steps=len(windows), device_processes=len(pids), stream_lines=len(streams))
    if not pids or not streams or not windows:
        out["note"] = ("no GPU stream events in the trace (on the CPU the profiler records no device streams)"
                       if not pids or not streams else f"no {marker}* annotations in the trace")
        return out
    names = op_names(hlo_text)
    per_step = defaultdict(list)
    copy_bytes = 0
    for lo, hi in windows:
        spans: dict[str, list] = defaultdict(list)
        copy_streams, kernel_streams = defaultdict(float), set()
        for e in events:
            if e.get("ph") != "X" or (e.get("pid"), e.get("tid")) not in streams:
                continue
            a = float(e["ts"])
            b = a + float(e.get("dur", 0.0))
            if a < lo or b > hi:
                continue
            kind = copy_direction(e)
            stream = streams[(e["pid"], e["tid"])]
            if kind in ("d2h", "h2d"):
                spans[kind].append((a, b))
                copy_streams[stream] += b - a
                m = _SIZE.search(json.dumps(e.get("args", {})))
                copy_bytes += int(m.group(1)) if m else 0
            elif kind == "d2d":
                spans["d2d"].append((a, b))
            else:
                spans["compute"].append((a, b))
                kernel_streams.add(stream)
                if layer_backward(names.get(str(e.get("args", {}).get("hlo_op", "")), "")):
                    spans["backward"].append((a, b))
        copies = spans["d2h"] + spans["h2d"]
        c, g = _union(copies), _union(spans["compute"])
        u = _union(copies + spans["compute"])
        own = sum(t for s, t in copy_streams.items() if s not in kernel_streams)
        per_step["step"].append(hi - lo)
        for key, value in (("d2h", _union(spans["d2h"])), ("h2d", _union(spans["h2d"])), ("copy", c),
                           ("d2d", _union(spans["d2d"])), ("compute", g), ("backward", _union(spans["backward"])),
                           ("overlap", c + g - u), ("sum", c + g), ("union", u), ("max", max(c, g))):
            per_step[key].append(value)
        per_step["copies_on_own_streams"].append(own / sum(copy_streams.values()) if copy_streams else None)
        per_step["copy_events"].append(len(copies))
        out.setdefault("copy_streams", set()).update(copy_streams)
        out.setdefault("kernel_streams", set()).update(kernel_streams)
    mean = lambda xs: None if any(x is None for x in xs) else sum(xs) / len(xs)  # noqa: E731
    ms = {f"{k}_ms": round(mean(v) / 1e3, 4) for k, v in per_step.items() if k not in (
        "copies_on_own_streams", "copy_events")}
    out.update(ms)
    out["backward_per_layer_ms"] = round(out["backward_ms"] / max(num_layers, 1), 4)
    out["hidden_fraction"] = round(out["overlap_ms"] / out["copy_ms"], 4) if out["copy_ms"] else None
    out["copies_on_own_streams"] = mean(per_step["copies_on_own_streams"])
    out["copy_events_per_step"] = mean(per_step["copy_events"])
    out["copy_bytes_per_step"] = copy_bytes // len(windows) if copy_bytes else None
    out["copy_streams"] = sorted(out.get("copy_streams", ()))
    out["kernel_streams"] = sorted(out.get("kernel_streams", ()))
    out["separate_copy_streams"] = (bool(out["copy_streams"]) and not set(out["copy_streams"]) & set(out["kernel_streams"]))
    if not any("transpose(" in n for n in names.values()):
        out["note"] = "no op under a transpose( name stack in the HLO: backward_ms is 0, not measured"
    return out


def trim_trace(trace: dict[str, Any], marker: str = STEP_MARKER, *, label: str = "", pid_offset: int = 0,
               max_events: int = 150_000) -> list[dict]:
    """The GPU stream events (and their process/thread names) of the trace's last annotated step, with pids moved
    by `pid_offset` and processes named after `label`, for one combined file of every variant."""
    events = trace.get("traceEvents", [])
    pids, thread = _lines(events)
    windows = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
               if e.get("ph") == "X" and str(e.get("name", "")).startswith(marker)]
    if not windows:
        return []
    lo, hi = max(windows)
    keep = []
    for e in events:
        key = (e.get("pid"), e.get("tid"))
        if e.get("pid") not in pids:
            continue
        if e.get("ph") == "M":
            e = dict(e, args=dict(e.get("args", {})))
            if e.get("name") == "process_name":
                e["args"]["name"] = f"{label} {e['args'].get('name', '')}".strip()
        elif not (e.get("ph") == "X" and key in thread and _STREAM.match(thread[key])
                  and lo <= float(e["ts"]) <= hi):
            continue
        keep.append(dict(e, pid=e["pid"] + pid_offset))
        if len(keep) >= max_events:
            break
    return keep


# ------------------------------------------------------------------------------------------- the profiled run
def parse_variant(text: str) -> dict[str, str]:
    """"policy:transfer:loop[:weights]" (e.g. offload:explicit:unroll; full's transfer is ignored). WEIGHTS is
    ExecutionConfig.frozen_weights, device (the default) or host: the layers' frozen weights streamed from pinned
    host memory, whose h2d copies then count as copies like the offload's."""
    parts = text.split(":")
    if (len(parts) not in (3, 4) or parts[1] not in ("policy", "explicit", "auto") or parts[2] not in ("scan", "unroll")
            or parts[3:] not in ([], ["device"], ["host"])):
        raise SystemExit(f"--variants: {text!r} is not POLICY:TRANSFER:LOOP[:WEIGHTS] with TRANSFER "
                         "policy|explicit|auto, LOOP scan|unroll and WEIGHTS device|host (e.g. offload:policy:scan:host)")
    return dict(policy=parts[0], transfer=parts[1], loop=parts[2], weights=(parts[3:] or ["device"])[0])


def run_variant(variant: dict[str, str], model_dir: str, seq: int, steps: int, warmup: int, profile_dir: str,
                dtype: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Profiles `steps` steps of one variant: (its record with the `analyse_trace` summary, the whole trace)."""
    import jax

    from scripts.bench.profile import load_trace
    from jaxft.memory.execution import ExecutionConfig
    from jaxft.run import Run
    from experiments.probes.max_context import make_batch, recipe, Settings

    config = recipe(Settings(model_dir=model_dir))
    execution = ExecutionConfig(remat=variant["policy"], layer_loop=variant["loop"],
                                offload_transfer=variant["transfer"], frozen_weights=variant["weights"])
    run = Run(model_dir, lora_config=config.lora_config, execution=execution, optim=config.optim_config, total_steps=1,
              dtype=dtype, seed=0)
    batch = make_batch(seq, run.model_config.vocab_size)
    rec: dict[str, Any] = dict(variant=":".join(variant.values()), seq=seq, layers=run.model_config.num_layers,
                               backend=jax.default_backend())
    compiled = run.compile(batch)
    rec["compile_s"] = round(run.compile_seconds, 1)
    hlo = compiled.as_text()
    if os.environ.get("OFFLOAD_OVERLAP_HLO_DIR"):  # the optimized HLO per variant, to read what each copy became
        name = re.sub(r"[^\w.+-]", "_", ":".join(variant.values()))
        Path(os.environ["OFFLOAD_OVERLAP_HLO_DIR"], f"{name}.hlo.txt").write_text(hlo)
    rec["host_values_in_hlo"] = hlo.count(":S(5)")
    run.init_random()
    on_device = jax.block_until_ready(jax.device_put(batch))
    for i in range(warmup):
        jax.block_until_ready(run.step(on_device, i)["loss"])
    # Unprofiled steps first: the profiler (and the command buffers turned off for it) may change the step time.
    plain = []
    for i in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(run.step(on_device, warmup + i)["loss"])
        plain.append(time.perf_counter() - t0)
    rec["step_ms_unprofiled"] = round(1e3 * sorted(plain)[len(plain) // 2], 2)
    times = []
    with jax.profiler.trace(profile_dir):
        for i in range(steps):
            t0 = time.perf_counter()
            with jax.profiler.TraceAnnotation(f"{STEP_MARKER}{i}"):
                loss = float(jax.block_until_ready(run.step(on_device, warmup + steps + i)["loss"]))
            times.append(time.perf_counter() - t0)
    rec["step_ms_wall"] = round(1e3 * sum(times) / len(times), 2)
    rec["loss"] = loss
    stats = jax.devices()[0].memory_stats() or {}
    rec["peak_bytes"] = stats.get("peak_bytes_in_use")
    trace = load_trace(profile_dir)
    rec.update(analyse_trace(trace, hlo, run.model_config.num_layers))
    return rec, trace


def _worker(args) -> int:
    variant = parse_variant(args.worker)
    with tempfile.TemporaryDirectory() as d:
        rec, trace = run_variant(variant, args.model_dir, args.seq, args.steps, args.warmup, d, args.dtype)
    if args.trace_part:
        with open(args.trace_part, "w") as f:
            json.dump(trim_trace(trace, label=rec["variant"], pid_offset=1000 * args.index), f)
    print(json.dumps(rec), flush=True)
    return 0


def compare(recs: list[dict]) -> list[str]:
    """One line per offload variant against full: per-layer backward, copy time and how much of it was hidden."""
    full = next((r for r in recs if r.get("variant", "").startswith("full") and r["variant"].endswith(":device")
                 and "backward_per_layer_ms" in r), None)
    lines = []
    for r in recs:
        if r is full or "copy_ms" not in r:
            if "error" in r or "note" in r:
                lines.append(f"{r.get('variant')}: {r.get('error') or r.get('note')}")
            continue
        extra = (f"; backward/layer {r['backward_per_layer_ms']:.3f} ms vs full {full['backward_per_layer_ms']:.3f} "
                 f"ms ({r['backward_per_layer_ms'] - full['backward_per_layer_ms']:+.3f})" if full else "")
        hidden = "-" if r["hidden_fraction"] is None else f"{100 * r['hidden_fraction']:.0f}%"
        lines.append(f"{r['variant']}: copies d2h {r['d2h_ms']:.2f} + h2d {r['h2d_ms']:.2f} ms/step "
                     f"({r['copy_events_per_step']} events), compute {r['compute_ms']:.2f} ms; copy+compute "
                     f"{r['sum_ms']:.2f} vs union {r['union_ms']:.2f} vs max {r['max_ms']:.2f} ms: {hidden} of the "
                     f"copy time hidden; copies on {'their own' if r['separate_copy_streams'] else 'shared'} "
                     f"streams {r['copy_streams']} (kernels on {r['kernel_streams']}){extra}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="a shape of scripts/bench/workloads.py or a directory")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--deadline-s", type=float, default=150.0, help="variants not started by then are skipped")
    ap.add_argument("--out", help="the JSON summary (required)")
    ap.add_argument("--trace", default=None, help="the last step of every variant, GPU streams only (.json.gz)")
    ap.add_argument("--keep-command-buffers", action="store_true",
                    help="leave XLA's CUDA-graph command buffers on where training has them: step times as users get "
                         "them, but kernels inside a graph may not name their HLO op, so the backward split is lost "
                         "(ExecutionConfig.program_options turns them off for policies that offload in the layer scan "
                         "and for streamed weights either way)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--trace-part", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    if not args.out:
        ap.error("--out is required: the JSON summary's path")
    began = time.time()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        parse_variant(v)
    from experiments.probes.max_context import model_dir

    work = tempfile.mkdtemp(prefix="offload_overlap_")
    directory = model_dir(args.model, args.layers, work)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "scripts"),
                                                       os.environ.get("PYTHONPATH", "")]))
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if not args.keep_command_buffers and "xla_gpu_enable_command_buffer" not in env.get("XLA_FLAGS", ""):
        # kernels name their HLO op (docstring)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    recs, parts = [], []
    for i, v in enumerate(variants):
        left = began + args.deadline_s - time.time()
        if left < 20:
            recs.append(dict(variant=v, error=f"skipped: {left:.0f} s left of --deadline-s"))
            continue
        part = os.path.join(work, f"trace_{i}.json")
        cmd = [sys.executable, "-m", "experiments.probes.offload_overlap", "--worker", v, "--model-dir", directory,
               "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup), "--dtype", args.dtype,
               "--index", str(i)] + (["--trace-part", part] if args.trace else [])
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left)
            lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
            recs.append(lines[-1] if lines else dict(variant=v, error=f"worker rc={p.returncode}: "
                                                                         f"{(p.stderr or p.stdout)[-800:]}"))
        except subprocess.TimeoutExpired:
            recs.append(dict(variant=v, error="killed at --deadline-s"))
        if os.path.exists(part):
            parts.append(part)
        print(json.dumps(recs[-1]), flush=True)
    summary = dict(model=args.model, layers=args.layers, seq=args.seq, steps=args.steps,
                   command_buffers=args.keep_command_buffers, variants=recs,
                   verdicts=compare(recs), wall_s=round(time.time() - began, 1))
    Path(args.out).write_text(json.dumps(summary, indent=1))
    if args.trace:
        events = []
        for part in parts:
            with open(part) as f:
                events += json.load(f)
        with gzip.open(args.trace, "wt") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, f)
    for line in summary["verdicts"]:
        print("# " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
