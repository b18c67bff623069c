"""Run by tests/test_mesh_auto.py with 2 host CPU devices: the per-device peak estimate of a tiny model's step on a
data-parallel and an fsdp mesh (XLA's memory analysis of the step compiled from shapes, the very programs `mesh: auto`
compiles for its candidates, so that it finds them in the compilation cache;
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
STEPS, SEQ_LEN, ROWS_PER_DEVICE = 2, 64, 2


def _config(model: str, data: str, out: str, mesh, max_memory_gb: float | None = None):
    from jaxft.train import TrainConfig

    return TrainConfig(model_name_or_path=model, dataset=data, output_dir=out, max_seq_length=SEQ_LEN,
                       per_device_train_batch_size=ROWS_PER_DEVICE, max_steps=STEPS, logging_steps=1, lora_r=4,
                       bf16=False, attention_implementation="reference", remat="none", layer_loop="scan", mesh=mesh,
                       max_memory_gb=max_memory_gb, disable_tqdm=True, report_to="none", seed=0)


def estimate(config) -> dict:
    """The compiled memory analysis (bytes per device) of the LoRA step that `config`'s run (its mesh given)
    compiles from shapes, as `mesh: auto` compiles each candidate (the same program: the auto run below finds it
    in the compilation cache), and its "peak" as `mesh: auto` reckons it; no weight is read."""
    from jaxft.memory import peak_estimate
    from jaxft.run import Run

    run = Run.from_config(config, STEPS)
    rows = ROWS_PER_DEVICE * run.placement.batch_parallel
    batch = {k: np.zeros((rows, SEQ_LEN), np.float32 if k == "loss_mask" else np.int32)
             for k in ("input_ids", "targets", "loss_mask", "segment_ids", "positions")}
    run.compile(batch)
    analysis = run.memory_analysis()
    return dict(analysis, peak=peak_estimate(analysis))


def main(model: str, data: str, out: str, result: str) -> int:
    from jaxft.train import train

    estimates = {kind: estimate(_config(model, data, out, mesh)) for kind, mesh in MESHES.items()}
    budget = (estimates["dp"]["peak"] + estimates["fsdp"]["peak"]) / 2 / 2**30
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # noqa: E731  (a handler that keeps lines)
    logging.getLogger("jaxft").addHandler(handler)
    logging.getLogger("jaxft").setLevel(logging.INFO)
    res = train(_config(model, data, out, "auto", budget))
    Path(result).write_text(json.dumps({"estimates": estimates, "budget_gib": budget,
                                        "mesh_lines": [s for s in lines if s.startswith("mesh auto")],
                                        "steps": res.global_step}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
