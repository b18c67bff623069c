#!/usr/bin/env python
"""HF+PEFT side of experiments/probes/bench_scaling.py: one point (system, mesh, N devices), run under torchrun with one
process per device, as accelerate runs data parallel and FSDP training for its users.

    python -m torch.distributed.run --standalone --nproc_per_node N experiments/probes/bench_scaling_hf.py \\
        --system hf_ckpt --mesh dp --workload 8b_4096 --steps 10 --json point.json

(bench_scaling.py starts it so, and one device with plain `python`: under torchrun accelerate would wrap even a
single process in DDP.) Each process builds the workload's model shape
with random bf16 weights on its device (transformers' init, the same seed on every rank), wraps it with the PEFT LoRA
of scripts.bench.torch_worker (the benchmark's targets, fp32 adapters), and hands it to
`accelerate.Accelerator.prepare`:

  dp    accelerate's DistributedDataParallel (the LoRA gradients all-reduced; every rank holds the whole model)
  fsdp  accelerate's FSDP2 (`FullyShardedDataParallelPlugin(fsdp_version=2)`, each decoder layer its own unit by
        transformers' `_no_split_modules`, resharded after forward; mixed precision "no": bf16 base weights and
        fp32 adapters as the model holds them, which FSDP2 accepts because each unit's trainable parameters, the
        adapters, share one dtype)

On one device neither: accelerate leaves the model as it is. accelerate shards with FSDP on GPUs only (on a CPU it
silently falls back to DDP), so a point whose distributed type is not the one asked for fails with one line.

Every rank trains its own rows of the global batch (the workload's rows per device, so the global batch grows with
N: weak scaling, as bench_scaling's jaxft points), the step of scripts.bench.torch_worker.train_loop (AdamW on the LoRA
parameters, gradient checkpointing per system), timed per step after a device sync. Rank 0 writes the point: per
step the slowest rank's time, the ranks' mean loss, every rank's allocator peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path


from scripts.bench.models import random_model  # noqa: E402
from scripts.bench.workloads import LORA, get_workload, make_token_data  # noqa: E402

SYSTEMS = ("hf_ckpt", "hf_nockpt")
GIB = 2**30


def accelerator(mesh: str, processes: int, cpu: bool):
    """The Accelerator of a point, and the distributed type it must have chosen (accelerate's names)."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    plugin, want = None, "NO"
    if processes > 1 and mesh == "fsdp":
        plugin, want = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                      reshard_after_forward=True), "FSDP"
    elif processes > 1:
        want = "MULTI_CPU" if cpu else "MULTI_GPU"
    return Accelerator(cpu=cpu, mixed_precision="no", fsdp_plugin=plugin), want


def run_point(system: str, mesh: str, workload_name: str, steps: int) -> dict | None:
    """This rank's part of the point; rank 0 returns the point's row (the others None)."""
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model

    from scripts.bench.torch_worker import _versions, hf_attention, hf_lora_targets, train_loop

    cpu = not torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    acc, want = accelerator(mesh, world, cpu)
    got = acc.distributed_type.name if hasattr(acc.distributed_type, "name") else str(acc.distributed_type)
    if got != want:
        if acc.process_index:  # rank 0 says why; the ranks' lines written at once interleave into one line
            raise SystemExit(1)
        why = {"FSDP": " (accelerate shards with FSDP on GPUs only)",
               "NO": " (one device runs without torchrun, which would make accelerate wrap it in DDP)"}.get(want, "")
        raise SystemExit(f"bench_scaling_hf: {mesh} on {world} {'CPU process' if cpu else 'GPU'}"
                         f"{'es' if cpu and world > 1 else 's' if world > 1 else ''} needs accelerate's {want}, it "
                         f"chose {got}{why}")
    device = "cpu" if cpu else "cuda"
    if not cpu:
        torch.cuda.set_device(acc.local_process_index)
    workload = get_workload(workload_name)
    rows = workload.batch
    data = make_token_data(dataclasses.replace(workload, batch=rows * world), steps + 1)
    data = data.rows(acc.process_index * rows, (acc.process_index + 1) * rows)
    config = workload.shape.config_dict()
    base = random_model(workload.shape, str(acc.device), seed=0,
                        attn_implementation=hf_attention(config, device))
    base.config.use_cache = False
    if system == "hf_ckpt":
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(0)  # LoRA A's draws: the same on every rank
    targets = hf_lora_targets(workload)
    model = get_peft_model(base, LoraConfig(r=LORA.r, lora_alpha=LORA.alpha, lora_dropout=LORA.dropout,
                                            bias="none", task_type="CAUSAL_LM", **targets))
    attn = base.config._attn_implementation
    model = acc.prepare(model)  # the optimizer is made after (FSDP2: over the sharded parameters)
    units = {}
    if got == "FSDP":  # how accelerate cut the model: each decoder layer, the embeddings, the head, the root
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                name = type(m).__name__.removeprefix("FSDP")
                units[name] = units.get(name, 0) + 1
    result = train_loop(model, workload, data, steps + 1, device)
    gathered = [None] * world
    mine = (result["step_times_s"], result["losses"],
            result["peak_memory_bytes"] if device == "cuda" else None)
    if world > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if acc.process_index:
        return None
    times = [max(t[i] for t, _, _ in gathered) for i in range(1, steps + 1)]  # step 0 is the warm-up
    losses = [statistics.fmean(l[i] for _, l, _ in gathered) for i in range(steps + 1)]
    tokens = int(data.input_ids[0].size) * world
    step_s = statistics.median(times)
    peaks = [round(p / GIB, 3) for _, _, p in gathered] if device == "cuda" else None
    return {"system": system, "mesh": mesh, "devices": world, "workload": workload_name, "tokens_per_step": tokens,
            "step_s": step_s, "step_times_s": times, "tokens_per_s": tokens / step_s,
            "tokens_per_s_per_device": tokens / step_s / world, "peak_gib_per_device": peaks, "losses": losses,
            "device_kind": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "distributed_type": got, "versions": _versions(),
            "settings": {"gradient_checkpointing": system == "hf_ckpt", "lora_targets": targets,
                         "attn_implementation": attn, "mixed_precision": "no (bf16 weights, fp32 LoRA)",
                         "fsdp_units": units or None}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", choices=SYSTEMS, required=True)
    p.add_argument("--mesh", choices=("dp", "fsdp"), required=True)
    p.add_argument("--workload", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    row = run_point(args.system, args.mesh, args.workload, args.steps)
    if row is not None:
        Path(args.json).write_text(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
