"""Device memory of the 8B LoRA step with the layers' frozen weights on the device and streamed from pinned host
memory (`frozen_weights: host`, packed as `jaxft.run.Run` packs them), per remat policy in the layer scan (default
remat offload: "lean" and "lean_host"), compiled for an H200 on a CPU machine (no GPU time): XLA's memory analysis of the loss-and-gradient
program (`jaxft.train.step.loss_and_grad_sums`; the optimizer update adds the LoRA state's AdamW moments, the same
for both) at 1 x 4096, 1 x 16384 and 1 x 65536, Pallas attention, autotuning off.

The compile target lists no host memory space (stream_schedule.py's docstring), so the packed
buffers enter on the device and the program's first op copies them to pinned host: the "device arguments" column
leaves them out (on the GPU they are host arguments), and "host" is what the program holds in host memory (the
weights and the offloaded layer inputs). The last column: GEMMs between the start and the done of each fetch from
host memory in the loop bodies of the compiled schedule (`hlo_schedule.gemms_under_fetches`; the weight rows, and for
an offloading policy the layer inputs coming back; 0 would be a fetch waited for before any compute).

    PYTHONPATH=/tmp/jax_cuda python -m experiments.deviceless.stream_memory [--seqs 4096,16384,65536]
        [--remats offload,offload+attn] [--remat 'offload=layer_input,attn_out' ...] [--weights device,host]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
from experiments.deviceless.gpu_compile import compile_for_h200  # noqa: E402  (sets the CUDA plugin up first)
from tests.hlo_text import gemms_under_fetches, host_slice_counts  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from scripts.bench.workloads import SHAPES  # noqa: E402
from jaxft.memory.execution import ExecutionConfig  # noqa: E402
from jaxft.lora import LoraConfig  # noqa: E402
from jaxft.memory.scan_offload import is_slot  # noqa: E402
from jaxft.run import Run  # noqa: E402
from jaxft.train.step import loss_and_grad_sums, stack_micro_batches  # noqa: E402

GIB = 2**30
HOST = jax.memory.Space.Host


def analysis(model_dir: str, seq: int, weights: str, remat: str = "offload") -> dict:
    execution = ExecutionConfig(attention_implementation="pallas", remat=remat, layer_loop="scan",
                                ce_chunk_size=256, frozen_weights=weights)
    run = Run(model_dir, LoraConfig(r=16, alpha=32, target_modules="all-linear"), execution=execution)
    graphdef, lora, frozen = run.abstract_state()
    strip = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)  # noqa: E731
    lora, frozen = strip(lora), strip(frozen)
    packed = sum(int(np.prod(s.rows.shape)) * s.rows.dtype.itemsize for s in {
        v.key: v for v in jax.tree.leaves(frozen, is_leaf=is_slot) if is_slot(v)}.values())
    host = {k: np.zeros((1, seq), np.float32 if k == "loss_mask" else np.int32)
            for k in ("input_ids", "targets", "loss_mask", "segment_ids", "positions")}
    batch = strip(stack_micro_batches(host, 1))

    def fn(lora, frozen, batch):
        # the packed buffers to pinned host first: stands in for host arguments (module docstring)
        frozen = jax.tree.map(lambda v: type(v)(jax.device_put(v.rows, HOST), *v.tree_flatten()[1])
                              if is_slot(v) else v, frozen, is_leaf=is_slot)
        return loss_and_grad_sums(graphdef, lora, frozen, batch, None, execution)[:2]

    compiled = compile_for_h200(fn, lora, frozen, batch, compiler_options=execution.program_options)
    m = compiled.memory_analysis()
    device_args = m.argument_size_in_bytes - packed
    text = compiled.as_text()
    copies, kernels = host_slice_counts(text)
    return {"seq": seq, "remat": remat, "weights": weights, "fetch_gemms": gemms_under_fetches(text),
            "host_slices_memcpy": copies, "host_slices_kernel": kernels,
            "device_arguments_gib": device_args / GIB,
            "temp_gib": m.temp_size_in_bytes / GIB, "device_gib": (device_args + m.temp_size_in_bytes) / GIB,
            "host_gib": (m.host_temp_size_in_bytes + m.host_argument_size_in_bytes) / GIB}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="4096,16384,65536")
    ap.add_argument("--remats", default=None, help="comma-separated remat policies (layer scan; default offload)")
    ap.add_argument("--remat", action="append", default=[],
                    help="one more remat policy, commas allowed (a selective 'save=...;offload=...'); repeatable")
    ap.add_argument("--weights", default="device,host", help="where the frozen weights are: device, host or both")
    args = ap.parse_args()
    remats = ([r for r in (args.remats or "").split(",") if r] + args.remat) or ["offload"]
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(SHAPES["llama-3.1-8b"].config_dict()))
        print("| row | remat | weights | device arguments | temp | device (GiB) | host (GiB) | GEMMs under each fetch "
              "| host slices: copies / kernels |\n|---|---|---|---:|---:|---:|---:|---|---|")
        for seq in map(int, args.seqs.split(",")):
            for remat in remats:
                for weights in args.weights.split(","):
                    r = analysis(d, seq, weights, remat)
                    print(f"| 1 x {seq} | {remat} | {weights} | {r['device_arguments_gib']:.2f} | "
                          f"{r['temp_gib']:.2f} | **{r['device_gib']:.2f}** | {r['host_gib']:.2f} | "
                          f"{', '.join(map(str, r['fetch_gemms'])) or '-'} | "
                          f"{r['host_slices_memcpy']} / {r['host_slices_kernel']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
