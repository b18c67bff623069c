"""Training checkpoints with orbax: LoRA params, optimizer state, step, data position and RNG.

Layout: `<output_dir>/checkpoints/<step>/{lora,opt_state,meta}`. orbax writes each checkpoint into a
temporary directory and renames it when complete, so a run killed mid-save leaves the previous checkpoint
intact (the partial one is an ignored, later cleaned, temporary directory). Saves are synchronous: LoRA
state is small, and a checkpoint that is reported saved is on disk.

Pytrees are stored as nested dicts of arrays keyed by their tree path (`opt_state/0/mu/layers/attn/...`)
and restored into the structure of a freshly built template, so the files do not depend on flax/optax
class layouts.

`meta` (JSON) holds: step (optimizer updates done), epoch and step_in_epoch (data position: the next
batch is `PackedDataset.batch(step)`), rng (key data of the training RNG), plus run facts (seed, rows per
step, seq_len, number of packed rows) that a resume checks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

logger = logging.getLogger("jaxft.train")


class CheckpointError(ValueError):
    """A checkpoint cannot be found, read, or does not match the run. The message names the path and fix."""


def _key_name(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def to_nested(tree: Any) -> dict:
    """A pytree as nested dicts {path component: ... : array} (leaf-less subtrees vanish)."""
    out: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        node = out
        names = [_key_name(k) for k in path] or ["_"]
        for name in names[:-1]:
            node = node.setdefault(name, {})
        node[names[-1]] = leaf
    return out


def from_nested(nested: dict, template: Any) -> Any:
    """Inverse of `to_nested`, shaped like `template`."""
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(template)
    leaves = []
    for path, _ in leaves_with_path:
        node = nested
        for name in [_key_name(k) for k in path] or ["_"]:
            node = node[name]
        leaves.append(node)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
    """Saves every `save_steps` (and on `force`), keeps the newest `max_to_keep` (None = all)."""

    def __init__(self, directory: str | Path, *, save_steps: int, max_to_keep: int | None = None):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=save_steps, max_to_keep=max_to_keep, create=True,
            enable_async_checkpointing=False, cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, lora, opt_state, meta: dict[str, Any], *, force: bool = False) -> Path | None:
        """Writes checkpoint `step` if it is due (or `force`); returns its directory, or None if not saved."""
        if not force and not self.manager.should_save(step):
            return None
        if step in self.manager.all_steps():
            return self.directory / str(step)
        args = ocp.args.Composite(
            lora=ocp.args.StandardSave(to_nested(lora)),
            opt_state=ocp.args.StandardSave(to_nested(opt_state)),
            meta=ocp.args.JsonSave(meta),
        )
        saved = self.manager.save(step, args=args, force=force)
        self.manager.wait_until_finished()
        return self.directory / str(step) if saved else None

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def close(self):
        self.manager.close()


def resolve(path: str | Path) -> tuple[Path, int]:
    """(checkpoints root, step) for a path that is a checkpoints root (latest step) or one step's directory."""
    p = Path(path).expanduser().absolute()
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path {str(p)!r} is not a directory; give output_dir/checkpoints or "
                              "output_dir/checkpoints/<step>")
    if p.name.isdigit() and (p / "meta").exists():
        return p.parent, int(p.name)
    if (p / "checkpoints").is_dir() and not (p / "meta").exists():
        p = p / "checkpoints"  # an output_dir was given
    steps = sorted(int(c.name) for c in p.iterdir() if c.name.isdigit() and (c / "meta").exists())
    if not steps:
        raise CheckpointError(f"no complete checkpoint in {p}; train with save_steps to write one, or drop "
                              "resume_from_checkpoint to start from scratch")
    return p, steps[-1]


def restore(path: str | Path, lora_template, opt_template) -> tuple[Any, Any, dict[str, Any]]:
    """(lora, opt_state, meta) of the checkpoint at `path` (see `resolve`), shaped like the templates."""
    root, step = resolve(path)
    manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(create=False))
    try:
        args = ocp.args.Composite(
            lora=ocp.args.StandardRestore(_abstract(to_nested(lora_template))),
            opt_state=ocp.args.StandardRestore(_abstract(to_nested(opt_template))),
            meta=ocp.args.JsonRestore(),
        )
        try:
            out = manager.restore(step, args=args)
        except (KeyError, ValueError) as e:
            raise CheckpointError(
                f"checkpoint {root / str(step)} does not match this model/LoRA setup ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); resume with the lora_r / lora_target_modules / "
                "model it was written with") from None
    finally:
        manager.close()
    lora = from_nested(out["lora"], lora_template)
    opt_state = from_nested(out["opt_state"], opt_template)
    meta = dict(out["meta"])
    meta["path"] = str(root / str(step))
    return lora, opt_state, meta


def rng_to_json(key: jax.Array) -> list[int]:
    return np.asarray(jax.random.key_data(key)).astype(np.uint32).tolist()


def rng_from_json(data: list[int]) -> jax.Array:
    return jax.random.wrap_key_data(np.asarray(data, dtype=np.uint32))
