"""Run by tests/test_full_finetune.py in a subprocess with 2 host CPU devices (JAX fixes its device count at start):
`python tests/full_finetune_worker.py MODEL_DIR OUT.json`. A full fine-tune on one device and under FSDP
({fsdp: 2}), the same batches; writes what the test asserts on:

- losses: each run's per-step losses;
- weights: the largest difference between the two runs' trained weights;
- specs: per trainable array of the FSDP run, its PartitionSpec and those of its AdamW moments (mu, nu).
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
import optax

from jaxft.lora import LoraConfig
from jaxft.memory.execution import ExecutionConfig
from jaxft.run import Run
from jaxft.sharding import MeshConfig
from jaxft.train.optim import OptimConfig

STEPS, ROWS, SEQ = 2, 4, 32


def _batch(step: int) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(step).integers(0, 64, (ROWS, SEQ + 1)).astype(np.int32)
    ones = np.ones((ROWS, SEQ), np.int32)
    return dict(input_ids=ids[:, :-1], targets=ids[:, 1:], loss_mask=ones, segment_ids=ones.copy(),
                positions=np.broadcast_to(np.arange(SEQ, dtype=np.int32), (ROWS, SEQ)).copy())


def _run(model_dir: str, mesh: MeshConfig, devices) -> Run:
    return Run(model_dir, LoraConfig(), dtype="float32", total_steps=STEPS, finetuning_type="full", mesh=mesh,
               devices=devices, execution=ExecutionConfig(attention_implementation="reference"),
               optim=OptimConfig(learning_rate=1e-2, lr_scheduler_type="constant", weight_decay=0.1)).load()


def _spec(x) -> str:
    return str(x.sharding.spec)


def main(model_dir: str, out: str) -> None:
    runs = {"one": _run(model_dir, MeshConfig(), jax.devices()[:1]), "fsdp": _run(model_dir, MeshConfig(fsdp=2),
                                                                                 jax.devices()[:2])}
    losses = {name: [float(run.step(_batch(s), s)["loss"]) for s in range(STEPS)] for name, run in runs.items()}
    one, fsdp = (jax.tree.leaves(runs[n].lora) for n in ("one", "fsdp"))
    weights = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(one, fsdp))
    adam = [s for s in jax.tree.leaves(runs["fsdp"].opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)][0]
    specs = {jax.tree_util.keystr(path): [_spec(w), _spec(m), _spec(v), list(w.shape)]
             for (path, w), m, v in zip(jax.tree_util.tree_flatten_with_path(runs["fsdp"].lora)[0],
                                        jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu))}
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"losses": losses, "weights": weights, "specs": specs}, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
