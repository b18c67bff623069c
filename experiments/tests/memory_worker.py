"""Run by tests/test_memory_table.py with 2 host CPU devices: scripts/memory_table.py's estimate of a tiny
model on a data-parallel and an fsdp mesh, then `mesh: auto` training with a max_memory_gb between the two
estimates (so pure data parallelism does not fit and fsdp does). Writes what it saw as JSON.

    memory_worker.py MODEL_DIR DATA.jsonl OUT_DIR RESULT.json
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))


def main(model: str, data: str, out: str, result: str) -> int:
    import memory_table

    from jaxft.train import TrainConfig, train

    hf = json.loads((Path(model) / "config.json").read_text())
    common = dict(devices=2, remat="none", seq_len=64, rows_per_device=2, lora_r=4, attention="reference",
                  dtype="float32")
    estimates = {kind: memory_table.estimate(hf, mesh=memory_table.mesh_of(kind, 2), **common)
                 for kind in ("dp", "fsdp")}
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
