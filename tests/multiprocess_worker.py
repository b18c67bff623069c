"""One process of a multi-process run, for tests/test_multiprocess.py (the JAXFT_* variables say which).

    multiprocess_worker.py train WRITES.jsonl CONFIG.yaml [--batches=OUT.npz] [jaxft-train args]
        `jaxft-train` itself, with a Python audit hook (sys.addaudithook, the interpreter's observation API)
        appending one line to WRITES.jsonl for every file this process creates, opens for writing, renames or
        removes under the config's output_dir outside checkpoints/ (orbax writes every process's shards there).
        Each line is written at once, so a SIGKILLed process leaves its record too. With --batches, the processes
        first do what `batches` does for the config's model and data (outside output_dir: not recorded), then
        train (already joined: jaxft-train's join is a no-op).
    multiprocess_worker.py batches OUT.npz MODEL DATA
        Joins the processes, packs only this process's rows of a few global batches (2 micro-batches, mesh
        data=2 x fsdp=2), saves them with their row positions, and the global device batch they make, fetched
        whole.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path


def _watch(output_dir: Path, log: Path) -> None:
    root, skip = str(output_dir), str(output_dir / "checkpoints")
    busy = []

    def record(event: str, path) -> None:
        path = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else None
        if path is None or busy:
            return
        path = os.path.abspath(path)
        if not path.startswith(root) or path.startswith(skip):
            return
        busy.append(1)  # the hook's own open() below must not record itself
        try:
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps({"event": event, "path": os.path.relpath(path, root)}) + "\n")
        finally:
            busy.pop()

    def hook(event: str, args) -> None:
        if event == "open" and len(args) >= 3:
            path, mode, flags = args[0], args[1], args[2]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if writes:
                record("open", path)
        elif event in ("os.rename", "os.replace"):
            record(event, args[1])
        elif event in ("os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree", "os.symlink"):
            record(event, args[0])

    sys.addaudithook(hook)


def train(log: str, config: str, *args: str) -> int:
    import yaml

    from jaxft.cli import main

    values = yaml.safe_load(Path(config).read_text())
    output_dir = Path(values["output_dir"]).absolute()
    _watch(output_dir, Path(log))
    if args and args[0].startswith("--batches="):
        batches(args[0].removeprefix("--batches="), values["model_name_or_path"], values["dataset"])
        args = args[1:]
    return main([config, *args])


def batches(out: str, model: str, data: str) -> int:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from jaxft import distributed
    from jaxft.data.pipeline import DataConfig, build_datasets
    from jaxft.sharding import MeshConfig, Placement
    from jaxft.train.step import stack_micro_batches

    assert distributed.initialize(distributed.DistributedConfig.from_value(None))
    placement = Placement(MeshConfig(data=2, fsdp=2))
    accumulation, rows = 2, 8  # 2 micro-batches of 4 rows: one row per device per micro-batch
    train_ds, _ = build_datasets(DataConfig(path=data, max_seq_length=64, batch_size=rows, seed=0), model)
    saved = {}
    for step in (0, 5, 13):  # 13: the second epoch (another shuffle)
        slots = placement.local_rows(rows, accumulation)
        local = train_ds.batch(step, slots)
        device = placement.batch(stack_micro_batches(local, accumulation))
        saved[f"slots_{step}"] = slots
        for key, value in local.items():
            saved[f"local_{step}_{key}"] = value
            saved[f"global_{step}_{key}"] = np.asarray(multihost_utils.process_allgather(device[key], tiled=True))
    np.savez(out, process=jax.process_index(), **saved)
    return 0


if __name__ == "__main__":
    gc.freeze()  # the import heap: full collections (the run's own among them) then skip it, as in conftest
    mode, *rest = sys.argv[1:]
    sys.exit({"train": train, "batches": batches}[mode](*rest))
