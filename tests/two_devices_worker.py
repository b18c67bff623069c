"""Run by tests/test_two_devices.py in one subprocess with 2 host CPU devices (JAX fixes its device count at start):
every scenario of the test files that needs exactly 2 devices, in one process (each process pays JAX's and jaxft's
start-up). `python tests/two_devices_worker.py WORKDIR OUT.json`; WORKDIR holds each scenario's inputs, and OUT.json
gets {"full": ..., "mesh_auto": ...} (the 8-bit AdamW runs leave their outputs under WORKDIR/adam8bit).

- full: a full fine-tune on one device and under FSDP ({fsdp: 2}), the same batches (WORKDIR/full_model): each
  run's per-step losses, the largest difference between the two runs' trained weights, and per trainable array of
  the FSDP run its PartitionSpec and those of its AdamW moments (mu, nu);
- adam8bit: `jaxft-train`'s `train` of examples/tiny-llama in full with 8-bit AdamW moments on {fsdp: 2}, 3 steps
  with checkpoints at steps 2 and 3 (WORKDIR/adam8bit/whole), then a run resumed from the checkpoint of step 2
  (WORKDIR/adam8bit/resumed);
- mesh_auto: the per-device peak estimate of a tiny model's LoRA step on a data-parallel and an fsdp mesh (XLA's
  memory analysis of the step compiled from shapes, the very programs `mesh: auto` compiles for its candidates, so
  that it finds them in the compilation cache; `jaxft.memory.budget.peak_estimate`), then `mesh: auto` training
  with a max_memory_gb between the two estimates (so pure data parallelism does not fit and fsdp does)
  (WORKDIR/mesh_auto_model, WORKDIR/mesh_auto.jsonl): the estimates, the lines `mesh: auto` logged, the steps run.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import jax
import numpy as np
import optax

from jaxft.lora import LoraConfig
from jaxft.memory import peak_estimate
from jaxft.memory.execution import ExecutionConfig
from jaxft.run import Run
from jaxft.sharding import MeshConfig
from jaxft.train import TrainConfig, train
from jaxft.train.optim import OptimConfig
from test_train_fixtures import logged_lines

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------ full fine-tune

FULL_STEPS, FULL_ROWS, FULL_SEQ = 2, 4, 32


def _full_batch(step: int) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(step).integers(0, 64, (FULL_ROWS, FULL_SEQ + 1)).astype(np.int32)
    ones = np.ones((FULL_ROWS, FULL_SEQ), np.int32)
    return dict(input_ids=ids[:, :-1], targets=ids[:, 1:], loss_mask=ones, segment_ids=ones.copy(),
                positions=np.broadcast_to(np.arange(FULL_SEQ, dtype=np.int32), (FULL_ROWS, FULL_SEQ)).copy())


def _full_run(model_dir: Path, mesh: MeshConfig, devices) -> Run:
    return Run(model_dir, LoraConfig(), dtype="float32", total_steps=FULL_STEPS, finetuning_type="full", mesh=mesh,
               devices=devices, execution=ExecutionConfig(attention_implementation="reference"),
               optim=OptimConfig(learning_rate=1e-2, lr_scheduler_type="constant", weight_decay=0.1)).load()


def _spec(x) -> str:
    return str(x.sharding.spec)


def full(model_dir: Path) -> dict:
    runs = {"one": _full_run(model_dir, MeshConfig(), jax.devices()[:1]),
            "fsdp": _full_run(model_dir, MeshConfig(fsdp=2), jax.devices()[:2])}
    losses = {name: [float(run.step(_full_batch(s), s)["loss"]) for s in range(FULL_STEPS)]
              for name, run in runs.items()}
    one, fsdp = (jax.tree.leaves(runs[n].lora) for n in ("one", "fsdp"))
    weights = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(one, fsdp))
    adam = [s for s in jax.tree.leaves(runs["fsdp"].opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)][0]
    specs = {jax.tree_util.keystr(path): [_spec(w), _spec(m), _spec(v), list(w.shape)]
             for (path, w), m, v in zip(jax.tree_util.tree_flatten_with_path(runs["fsdp"].lora)[0],
                                        jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu))}
    return {"losses": losses, "weights": weights, "specs": specs}


# ------------------------------------------------------------------------------------------------ 8-bit AdamW


def adam8bit(out: Path) -> None:
    def run(name: str, **over):
        values = dict(model_name_or_path=str(REPO / "examples/tiny-llama"),
                      dataset=str(REPO / "examples/data/train.jsonl"), output_dir=str(out / name),
                      finetuning_type="full", optim="adamw_8bit", mesh={"fsdp": 2}, max_seq_length=64,
                      per_device_train_batch_size=2, max_steps=3, save_steps=2, logging_steps=1, learning_rate=1e-3,
                      lr_scheduler_type="constant", bf16=False, disable_tqdm=True, report_to="none", seed=0)
        train(TrainConfig.from_dict({**values, **over}))

    run("whole")  # checkpoints at steps 2 and 3
    run("resumed", resume_from_checkpoint=str(out / "whole" / "checkpoints" / "2"))


# ------------------------------------------------------------------------------------------------ mesh: auto

AUTO_MESHES = {"dp": {"data": 2, "fsdp": 1}, "fsdp": {"data": 1, "fsdp": 2}}
AUTO_STEPS, AUTO_SEQ_LEN, AUTO_ROWS_PER_DEVICE = 2, 64, 2


def _auto_config(model: Path, data: Path, out: Path, mesh, max_memory_gb: float | None = None) -> TrainConfig:
    return TrainConfig(model_name_or_path=str(model), dataset=str(data), output_dir=str(out),
                       max_seq_length=AUTO_SEQ_LEN, per_device_train_batch_size=AUTO_ROWS_PER_DEVICE,
                       max_steps=AUTO_STEPS, logging_steps=1, lora_r=4, bf16=False,
                       attention_implementation="reference", remat="none", layer_loop="scan", mesh=mesh,
                       max_memory_gb=max_memory_gb, disable_tqdm=True, report_to="none", seed=0)


def _estimate(config: TrainConfig) -> dict:
    """The compiled memory analysis (bytes per device) of the LoRA step that `config`'s run (its mesh given)
    compiles from shapes, as `mesh: auto` compiles each candidate, and its "peak" as `mesh: auto` reckons it; no
    weight is read."""
    run = Run.from_config(config, AUTO_STEPS)
    rows = AUTO_ROWS_PER_DEVICE * run.placement.batch_parallel
    batch = {k: np.zeros((rows, AUTO_SEQ_LEN), np.float32 if k == "loss_mask" else np.int32)
             for k in ("input_ids", "targets", "loss_mask", "segment_ids", "positions")}
    run.compile(batch)
    analysis = run.memory_analysis()
    return dict(analysis, peak=peak_estimate(analysis))


def mesh_auto(model: Path, data: Path, out: Path) -> dict:
    estimates = {kind: _estimate(_auto_config(model, data, out, mesh)) for kind, mesh in AUTO_MESHES.items()}
    budget = (estimates["dp"]["peak"] + estimates["fsdp"]["peak"]) / 2 / 2**30
    with logged_lines("jaxft") as lines:
        res = train(_auto_config(model, data, out, "auto", budget))
    return {"estimates": estimates, "budget_gib": budget,
            "mesh_lines": [s for s in lines if s.startswith("mesh auto")], "steps": res.global_step}


def main(workdir: Path, out: Path) -> None:
    assert len(jax.devices()) == 2, jax.devices()
    results = {"full": full(workdir / "full_model"),
               "mesh_auto": mesh_auto(workdir / "mesh_auto_model", workdir / "mesh_auto.jsonl",
                                      workdir / "mesh_auto_out")}
    adam8bit(workdir / "adam8bit")
    out.write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    gc.freeze()  # the import heap: full collections (the run's own among them) then skip it, as in conftest
    main(Path(sys.argv[1]), Path(sys.argv[2]))
