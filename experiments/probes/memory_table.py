#!/usr/bin/env python
"""Per-device memory of LoRA training on 1-8 devices, on paper: XLA's compiled memory analysis of the training
step, compiled from abstract inputs (shapes with shardings, `jaxft.run.Run.compile` before any weight exists),
so an 8B or 70B model "fits" in the table without a byte of it being allocated.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m experiments.probes.memory_table --models 8b,70b --devices 1,2,4,8 --remat none,full --md table.md

Per-device peak = arguments (frozen weights, LoRA, optimizer state, batch: each device's shards) + outputs +
temporaries - outputs aliased to donated inputs + the allocator's rounding (2% of arguments;
`jaxft.memory.budget.peak_estimate`, what `remat: auto` and `mesh: auto` use). Meshes: "dp" = every device on data
(weights replicated), "fsdp" = every device on fsdp (frozen weights split on their hidden dimension); both split
the batch rows, 1 row of `--seq` tokens per device.

This is the CPU compiler's analysis, an approximation of the GPU's: the CPU backend fuses differently and
has no cuDNN; attention runs the Pallas flash kernel in interpret mode (`--attention pallas`, O(T) memory
like the GPU kernel; "reference" would materialise [T, T] scores) and the layers run as a scan.
`--calibrate` divides a measured GPU peak by the CPU estimate of the same setting, to say how far off it is.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np


GIB = 2**30
MESHES = ("dp", "fsdp")


def model_configs() -> dict[str, dict]:
    """HF config.json dicts of the shapes in the table (the benchmark's Llama-3.1-8B and -70B shapes)."""
    from scripts.bench.workloads import SHAPES

    return {"8b": SHAPES["llama-3.1-8b"].config_dict(), "70b": SHAPES["llama-3.1-70b"].config_dict()}


def mesh_of(kind: str, devices: int) -> dict[str, int]:
    return {"data": devices, "fsdp": 1} if kind == "dp" else {"data": 1, "fsdp": devices}


def estimate(hf_config: dict, *, devices: int, mesh: dict[str, int], remat: str = "none", seq_len: int = 4096,
             rows_per_device: int = 1, lora_r: int = 16, attention: str = "pallas", dtype: str = "bfloat16",
             layer_loop: str = "scan") -> dict:
    """XLA's memory analysis (bytes per device) of the LoRA step of a model shaped by `hf_config` (a config.json
    dict) on the first `devices` devices with `mesh`, all-linear LoRA of rank `lora_r`, `rows_per_device` rows
    of `seq_len` tokens per batch-parallel device; "peak" is `jaxft.memory.budget.peak_estimate`. No weight is read."""
    import jax

    from jaxft.memory.execution import ExecutionConfig
    from jaxft.lora import LoraConfig
    from jaxft.memory import peak_estimate
    from jaxft.run import Run
    from jaxft.sharding import MeshConfig

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(hf_config))
        run = Run(d, lora_config=LoraConfig(r=lora_r, alpha=2.0 * lora_r, target_modules="all-linear"),
                  execution=ExecutionConfig(attention_implementation=attention, remat=remat, layer_loop=layer_loop),
                  dtype=dtype, devices=jax.devices()[:devices], mesh=MeshConfig(**mesh))
        rows = rows_per_device * run.placement.batch_parallel
        batch = {k: np.zeros((rows, seq_len), np.float32 if k == "loss_mask" else np.int32)
                 for k in ("input_ids", "targets", "loss_mask", "segment_ids", "positions")}
        run.compile(batch)
        analysis = run.memory_analysis()
    return dict(analysis, peak=peak_estimate(analysis), compile_seconds=round(run.compile_seconds, 1))


def _row(model, kind, devices, remat, m) -> str:
    gib = lambda k: f"{m[k] / GIB:.2f}"  # noqa: E731
    return (f"| {model} | {kind} | {devices} | {remat} | {gib('argument_size_in_bytes')} | "
            f"{gib('temp_size_in_bytes')} | {gib('output_size_in_bytes')} | {gib('alias_size_in_bytes')} | "
            f"**{gib('peak')}** |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="8b,70b")
    p.add_argument("--devices", default="1,2,4,8")
    p.add_argument("--meshes", default="dp,fsdp")
    p.add_argument("--remat", default="none,full")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--attention", default="pallas")
    p.add_argument("--calibrate", default=None, metavar="MODEL:DEVICES:MESH:REMAT:GIB",
                   help="a measured GPU peak to set against the same row, e.g. 8b:1:dp:none:27.76")
    p.add_argument("--json", default=None, help="write every row as JSON here (appended to as it goes)")
    p.add_argument("--md", default=None, help="write the markdown table here")
    args = p.parse_args(argv)
    import jax

    configs = model_configs()
    rows, results = [], []
    header = ("| model | mesh | devices | remat | arguments | temp | outputs | aliased | per-device peak (GiB) |\n"
              "|---|---|---:|---|---:|---:|---:|---:|---:|")
    for model in args.models.split(","):
        for n in map(int, args.devices.split(",")):
            if n > jax.device_count():
                raise SystemExit(f"--devices {n}: only {jax.device_count()} devices; set XLA_FLAGS="
                                 f"--xla_force_host_platform_device_count={n}")
            for kind in args.meshes.split(","):
                if n == 1 and kind != MESHES[0]:
                    continue  # one device: every mesh is the same
                for remat in args.remat.split(","):
                    m = estimate(configs[model], devices=n, mesh=mesh_of(kind, n), remat=remat, seq_len=args.seq,
                                 attention=args.attention)
                    results.append(dict(model=model, mesh=kind, devices=n, remat=remat, **m))
                    rows.append(_row(model, kind, n, remat, m))
                    print(rows[-1], f"(compiled in {m['compile_seconds']} s)", flush=True)
                    if args.json:
                        Path(args.json).write_text(json.dumps(results, indent=1))
    notes = []
    if args.calibrate:
        model, n, kind, remat, gib = args.calibrate.split(":")
        match = [r for r in results if (r["model"], r["devices"], r["mesh"], r["remat"]) == (model, int(n), kind, remat)]
        if match:
            ratio = float(gib) / (match[0]["peak"] / GIB)
            notes.append(f"Calibration: measured {gib} GiB on one H200 for {model}, {n} device(s), {kind}, remat "
                         f"{remat}; this table says {match[0]['peak'] / GIB:.2f} GiB (GPU / CPU = {ratio:.2f}).")
    from scripts.bench.report import heading

    title = heading("-m experiments.probes.memory_table", argv or sys.argv[1:])
    text = "\n".join([title, "", header, *rows, "", *notes]) + "\n"
    if args.md:
        Path(args.md).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
