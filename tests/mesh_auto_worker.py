"""Run by tests/test_mesh_auto.py with 2 host CPU devices: the per-device peak estimate of a tiny model's step on a
data-parallel and an fsdp mesh (XLA's memory analysis of the step compiled from shapes,
`jaxft.memory.budget.peak_estimate`), then `mesh: auto` training with a max_memory_gb between the two estimates (so pure
data parallelism does not fit and fsdp does). Writes what it saw as JSON.

    python tests/mesh_auto_worker.py MODEL_DIR DATA.jsonl OUT_DIR RESULT.json
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np

MESHES = {"dp": {"data": 2, "fsdp": 1}, "fsdp": {"data": 1, "fsdp": 2}}


def estimate(model: str, mesh: dict[str, int], seq_len: int = 64, rows_per_device: int = 2) -> dict:
    """The compiled memory analysis (bytes per device) of the model's LoRA step (r 4, all linears) on `mesh`, and
    its "peak" as `mesh: auto` reckons it; no weight is read."""
    import jax

    from jaxft.memory import peak_estimate
    from jaxft.memory.execution import ExecutionConfig
    from jaxft.lora import LoraConfig
    from jaxft.run import Run
    from jaxft.sharding import MeshConfig

    run = Run(model, lora_config=LoraConfig(r=4, alpha=8.0, target_modules="all-linear"),
              execution=ExecutionConfig(attention_implementation="reference", remat="none", layer_loop="scan"),
              dtype="float32", devices=jax.devices()[:2], mesh=MeshConfig(**mesh))
    rows = rows_per_device * run.placement.batch_parallel
    batch = {k: np.zeros((rows, seq_len), np.float32 if k == "loss_mask" else np.int32)
             for k in ("input_ids", "targets", "loss_mask", "segment_ids", "positions")}
    run.compile(batch)
    analysis = run.memory_analysis()
    return dict(analysis, peak=peak_estimate(analysis))


def main(model: str, data: str, out: str, result: str) -> int:
    from jaxft.train import TrainConfig, train

    estimates = {kind: estimate(model, mesh) for kind, mesh in MESHES.items()}
    budget = (estimates["dp"]["peak"] + estimates["fsdp"]["peak"]) / 2 / 2**30
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # noqa: E731  (a handler that keeps lines)
    logging.getLogger("jaxft").addHandler(handler)
    logging.getLogger("jaxft").setLevel(logging.INFO)
    config = TrainConfig(model_name_or_path=model, dataset=data, output_dir=out, max_seq_length=64,
                         per_device_train_batch_size=2, max_steps=2, logging_steps=1, lora_r=4, bf16=False,
                         attention_implementation="reference", remat="none", layer_loop="scan", mesh="auto",
                         max_memory_gb=budget, disable_tqdm=True, report_to="none", seed=0)
    res = train(config)
    Path(result).write_text(json.dumps({"estimates": estimates, "budget_gib": budget,
                                        "mesh_lines": [s for s in lines if s.startswith("mesh auto")],
                                        "steps": res.global_step}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
