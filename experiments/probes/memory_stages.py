#!/usr/bin/env python
"""What the device's allocator holds at each stage of a run's setup, against the bytes of the live arrays.

Why: before its first step the Qwen3-30B-A3B lean row held 2.74 GB more than its state (weights, LoRA, optimizer,
batches), and no live array accounted for it (docs/benchmarks.md sections 23-24). XLA's BFC allocator counts a
whole chunk as in use when it hands out a free chunk less than twice the request and less than 128 MiB larger,
so the order in which buffers are made and freed can leave memory in use that no array owns. This prints, per
stage, `bytes_in_use`, the bytes of the distinct live buffers (`scripts.bench.jaxft_worker.distinct_buffers`) and their
difference, so the stage that adds it is named.

    python3 -m experiments.probes.memory_stages --model-dir DIR --workload qwen3_30b_a3b_4096 \\
        --mode lean --out $OUT/memory_stages.json

A --model-dir without a config.json gets the workload shape's random-weight model first (bench.models).
Stages: compile (from shapes, as the benchmark worker does), load (`Run.load`), the worker's state reset in its
old order (the new optimizer state made before the old state is released) and in the order `Run.set_state`
now uses, one step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys



def snapshot(label: str, device) -> dict:
    import jax

    from scripts.bench.jaxft_worker import distinct_buffers

    stats = device.memory_stats() or {}
    live = int(sum(x.nbytes for x in distinct_buffers(jax.live_arrays()).values()))
    rec = {"stage": label, "bytes_in_use": int(stats.get("bytes_in_use", 0)), "live_array_bytes": live,
           "largest_free_block_bytes": int(stats.get("largest_free_block_bytes", 0)),
           "num_allocs": int(stats.get("num_allocs", 0)), "peak_bytes_in_use": int(stats.get("peak_bytes_in_use", 0))}
    rec["in_use_minus_live"] = rec["bytes_in_use"] - live
    print(f"[stages] {label:>28}: in use {rec['bytes_in_use'] / 1e9:8.3f} GB, live arrays {live / 1e9:8.3f} GB, "
          f"difference {rec['in_use_minus_live'] / 1e9:7.3f} GB", flush=True)
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--workload", default="qwen3_30b_a3b_4096")
    p.add_argument("--mode", default="lean")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import jax

    from scripts.bench.workloads import get_workload, make_token_data
    from scripts.bench.jaxft_worker import mode_config
    from jaxft.run import Run

    workload = get_workload(args.workload)
    device = jax.devices()[0]
    if not os.path.exists(os.path.join(args.model_dir, "config.json")):
        from scripts.bench.models import save_random_model
        saved = save_random_model(workload.shape, args.model_dir, "cuda" if device.platform == "gpu" else "cpu")
        print(f"[stages] saved the {workload.shape.name} model in {saved['save_s']:.0f} s", flush=True)
    dtype = "bfloat16" if device.platform == "gpu" else "float32"
    config = mode_config(args.mode, args.model_dir, workload, dtype)
    batch = make_token_data(workload, 1).step(0)
    stages = [snapshot("start", device)]

    run = Run.from_config(config, total_steps=2)
    run.compile(batch)
    stages.append(snapshot("compiled (no weights)", device))
    run.load()
    stages.append(snapshot("Run.load", device))
    lora0 = jax.device_get(run.lora)
    # The benchmark worker's old order: the new optimizer state is made while the old state is alive.
    run.set_state(lora0, run.optimizer.init(lora0))
    stages.append(snapshot("reset, new state first", device))
    run.set_state(lora0)
    stages.append(snapshot("reset, Run.set_state(lora)", device))
    batch_d = jax.device_put(batch)
    metrics = run.step(batch_d, 0)
    jax.block_until_ready(metrics["loss"])
    stages.append(snapshot("after one step", device))
    gc.collect()
    stages.append(snapshot("after gc.collect()", device))
    result = {"workload": args.workload, "mode": args.mode, "device": str(device.device_kind), "stages": stages,
              "memory_analysis": run.memory_analysis()}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
