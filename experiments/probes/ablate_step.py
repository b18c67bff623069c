#!/usr/bin/env python
"""Ablations of jaxft's training step in ONE process: the model is loaded once, each variant is compiled
and timed on the same batches (median of the steps after the warm-up, device-synchronised), and its
compiled memory (XLA's temp/argument/output sizes) is recorded. Variants differ in remat policy and in
per-program XLA options; one variant can also be profiled (category split as scripts/bench/profile.py).
The remat part is any policy of jaxft.memory.policy without a ";" (e.g. "offload+attn",
"offload=layer_input,mlp_gate_up").

The numbers that go into the scoreboard come from scripts/bench/train.py (fresh process per system, the
allocator's peak); this script is for deciding what the defaults should be, quickly, on the device.

    python -m experiments.probes.ablate_step --model-dir DIR --workload 8b_4096 \\
        --variants 'none;none+dsf;offload+dsf' --profile none+dsf --out $OUT/ablate.json

A --model-dir without a config.json gets the workload shape's random-weight model first (bench.models, as
scripts/bench/train.py saves it), e.g. a GPT-OSS-20B profile in one device call:

    python3 -m experiments.probes.ablate_step --model-dir /dev/shm/gpt_oss --workload gpt_oss_20b_4096 \\
        --variants 'offload;none' --profile offload --out $OUT/ablate.json

Every variant is the benchmark's fast recipe (examples/bench/fast.yaml, through jaxft.run.Run) with other
execution settings over the same loaded weights. A variant is `remat[+option...][@ce_chunk]`, options:
unroll (per-layer weight buffers, layers unrolled), xscan (offload_transfer explicit: jaxft/memory/scan_offload.py's
hand-written scan VJP instead of the policy's copies), dsf (xla_gpu_enable_dynamic_slice_fusion), nocb (command
buffers off: per-op profile attribution), nopho (xla_gpu_enable_pipelined_host_offloading off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


OPTIONS = {
    "dsf": {"xla_gpu_enable_dynamic_slice_fusion": True},
    "nocb": {"xla_gpu_enable_command_buffer": ""},
    # Without XLA's pipelined host offloading, which ExecutionConfig.program_options turns on for an offloading
    # policy in the layer scan (the A/B of that default).
    "nopho": {"xla_gpu_enable_pipelined_host_offloading": False},
}


def parse_variant(text: str) -> tuple[str, dict, int | None, bool, str]:
    text, _, chunk = text.partition("@")
    remat, *opts = text.split("+")
    if opts[:1] == ["attn"]:  # the policy "offload+attn", not an option
        remat, opts = "offload+attn", opts[1:]
    unroll = "unroll" in opts
    transfer = "explicit" if "xscan" in opts else "auto"
    opts = [o for o in opts if o not in ("unroll", "xscan")]
    unknown = [o for o in opts if o not in OPTIONS]
    if unknown:
        raise SystemExit(f"variant {text!r}: unknown options {unknown}; known {sorted(OPTIONS)}")
    merged: dict = {}
    for o in opts:
        merged.update(OPTIONS[o])
    return remat, merged, int(chunk) if chunk else None, unroll, transfer


def _save_model(workload: str, model_dir: str) -> None:
    import torch

    from scripts.bench.models import save_random_model
    from scripts.bench.workloads import get_workload

    shape = get_workload(workload).shape
    saved = save_random_model(shape, model_dir, "cuda" if torch.cuda.is_available() else "cpu")
    print(f"[ablate] saved the {shape.name} model in {saved['save_s']:.0f} s", flush=True)


def save_model_apart(workload: str, model_dir: str) -> None:
    """Save the workload's random model in a child process, before this one imports JAX. Why: the saving
    process keeps torch's host copy of the weights; loading them again beside it was killed for host memory on
    Qwen3-30B-A3B (61 GB in /dev/shm + 61 GB in the process, on a 125 GiB host)."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=_save_model, args=(workload, model_dir))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise SystemExit(f"ablate_step.py: saving the {workload} model to {model_dir} failed "
                         f"(exit code {child.exitcode}); see the lines above")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--workload", default="8b_4096")
    p.add_argument("--variants", default="none;none+dsf")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ce-chunk", type=int, default=None)
    p.add_argument("--profile", default=None, help="variant to profile (3 steps) after the timings")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    from scripts.bench.workloads import get_workload, make_token_data

    workload = get_workload(args.workload)
    if not os.path.exists(os.path.join(args.model_dir, "config.json")):
        save_model_apart(args.workload, args.model_dir)

    import jax

    from scripts.bench.profile import load_trace, summarize_trace
    from scripts.bench.jaxft_worker import mode_config
    from jaxft.run import Run

    data = make_token_data(workload, args.steps)
    host_batches = [data.step(i) for i in range(args.steps)]
    batches = [jax.device_put(b) for b in host_batches]
    results = {"workload": args.workload, "device": str(jax.devices()[0].device_kind), "variants": {}}
    # The benchmark's fast recipe (examples/bench/fast.yaml) loaded once; each variant is the same run with
    # other execution settings over the same weights (Run.variant), starting from the same LoRA init.
    config = mode_config("fast", args.model_dir, workload, "bfloat16").replace(layer_loop="scan")
    t0 = time.perf_counter()
    base = Run.from_config(config, total_steps=args.steps).load()
    results["load_s"] = time.perf_counter() - t0
    lora0 = jax.device_get(base.lora)

    def build(variant: str):
        remat, options, chunk, unroll, transfer = parse_variant(variant)
        execution = config.execution_config.replace(remat=remat, compiler_options=options,
                                                    offload_transfer=transfer, ce_chunk_size=chunk or args.ce_chunk,
                                                    layer_loop="unroll" if unroll else "scan")
        return base.variant(execution, lora=lora0)

    for variant in [v for v in args.variants.split(";") if v]:
        run = build(variant)
        rec: dict = {}
        try:
            compiled = run.compile(host_batches[0])
            rec["compile_s"] = run.compile_seconds
            rec["memory"] = run.memory_analysis()
            times, losses = [], []
            for i in range(args.steps):
                t0 = time.perf_counter()
                metrics = run.step(batches[i], 0)  # one key for every step: variants see the same batches
                losses.append(float(jax.block_until_ready(metrics["loss"])))
                times.append(time.perf_counter() - t0)
            med = statistics.median(times[args.warmup:])
            rec.update(status="ok", median_step_s=med, tokens_per_s=workload.tokens_per_step / med,
                       step_times_s=times, losses=losses)
            if variant == args.profile:
                prof = f"/tmp/ablate_prof_{os.getpid()}"
                t0 = time.perf_counter()
                with jax.profiler.trace(prof):
                    for i in range(3):
                        metrics = run.step(batches[i], 0)
                    jax.block_until_ready(metrics["loss"])
                rec["profile"] = summarize_trace(load_trace(prof), load_step_hlo_text(compiled), 3,
                                                 time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - an OOM or a compile failure is a result of the variant
            rec.update(status="error", error=f"{type(e).__name__}: {str(e)[:600]}")
        stats = jax.devices()[0].memory_stats() or {}
        rec["process_peak_bytes"] = int(stats.get("peak_bytes_in_use", 0))
        results["variants"][variant] = rec
        print(f"[ablate] {variant:>16}: " + (f"{rec['median_step_s'] * 1e3:.1f} ms, {rec['tokens_per_s']:,.0f} tok/s, "
                                             f"temp {rec['memory']['temp_size_in_bytes'] / 2**30:.2f} GiB, "
                                             f"loss {rec['losses'][-1]:.4f}, compile {rec['compile_s']:.0f}s"
                                             if rec["status"] == "ok" else rec["error"][:300]), flush=True)
        del run
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def load_step_hlo_text(compiled) -> str:
    """The optimized HLO of the compiled step (op_name metadata maps kernels to jaxft's scopes)."""
    try:
        return compiled.as_text()
    except Exception:  # noqa: BLE001
        return ""


if __name__ == "__main__":
    sys.exit(main())
