"""Training checkpoints with orbax: LoRA params, optimizer state, step, data position and RNG.

Layout: `<output_dir>/checkpoints/<step>/{lora,opt_state,meta,jaxft-manifest.json}`. orbax writes each checkpoint
into a temporary directory and renames it when complete, so a run killed mid-save leaves the previous checkpoint
intact (the partial one is an ignored, later cleaned, temporary directory). Saves are synchronous: LoRA
state is small, and a checkpoint that is reported saved is on disk.

The manifest (size and sha256 of every file, written after orbax finishes, by rename) is what a restore checks
first; the restored values must then be finite. A checkpoint failing either is named with its bad file and
skipped for the next older one (`restore`), unless the user named that one step.

Pytrees are stored as nested dicts of arrays keyed by their tree path (`opt_state/0/mu/layers/attn/...`)
and restored into the structure of a freshly built template, so the files do not depend on flax/optax
class layouts.

`meta` (JSON) holds: step (optimizer updates done), epoch and step_in_epoch (data position: the next
batch is `PackedDataset.batch(step)`), rng (key data of the training RNG), plus run facts (seed, rows per
step, max_seq_length, number of packed rows) that a resume checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
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


MANIFEST = "jaxft-manifest.json"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name not in (MANIFEST, MANIFEST + ".tmp"))


def write_manifest(step_dir: Path) -> None:
    """Records the size and sha256 of every file of a finished checkpoint (atomically: a temporary file renamed)."""
    files = {p.relative_to(step_dir).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in _files(step_dir)}
    tmp = step_dir / (MANIFEST + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / MANIFEST)


def verify(step_dir: Path) -> str | None:
    """None when every file matches the manifest; otherwise what is wrong, naming the file. A checkpoint without
    a manifest (an older jaxft's, or a run killed between orbax's rename and the manifest's) cannot be told from
    a corrupt one: bytes flipped in the array data restore as finite garbage, so it counts as damaged."""
    manifest = step_dir / MANIFEST
    if not manifest.exists():
        return (f"{manifest} is missing (the run was killed before the save finished, or an older jaxft without "
                "checksums wrote it)")
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        assert isinstance(files, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return f"{manifest} is unreadable"
    for rel, want in files.items():
        path = step_dir / rel
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != want.get("bytes"):
            return f"{path} has {path.stat().st_size} bytes, the manifest says {want.get('bytes')} (truncated?)"
        if _sha256(path) != want.get("sha256"):
            return f"{path} does not match its sha256 in the manifest (corrupt)"
    return None


@jax.jit
def _all_finite(arrays: list) -> list:
    """One program for the whole tree (eager ops would compile two per array shape)."""
    return [jnp.isfinite(x).all() for x in arrays]


def first_nonfinite(nested: dict, prefix: str) -> str | None:
    """The path of the first array with a NaN or infinity in `nested` (checked on the device), or None."""
    leaves = jax.tree_util.tree_flatten_with_path(nested)[0]
    floats = [(path, x) for path, x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    finite = jax.device_get(_all_finite([x for _, x in floats]))
    for (path, _), ok in zip(floats, finite):
        if not ok:
            return "/".join([prefix, *(_key_name(k) for k in path)])
    return None


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
        if not saved:
            return None
        if jax.process_index() == 0:
            write_manifest(self.directory / str(step))
        return self.directory / str(step)

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


def _steps(root: Path) -> list[int]:
    return sorted((int(c.name) for c in root.iterdir() if c.name.isdigit() and (c / "meta").exists()), reverse=True)


def read_meta(step_dir: Path) -> dict[str, Any]:
    """A checkpoint's `meta` record; CheckpointError naming the file when it is not a JSON object."""
    path = step_dir / "meta" / "metadata"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__})") from None
    if not isinstance(meta, dict) or not all(k in meta for k in ("step", "rng", "epoch", "step_in_epoch")):
        raise CheckpointError(f"{path} is not a jaxft checkpoint record")
    return meta


@dataclasses.dataclass(frozen=True)
class Restored:
    """A restored checkpoint; `skipped` holds the (directory, problem) of newer ones found damaged."""

    lora: Any
    opt_state: Any
    meta: dict[str, Any]
    path: Path
    skipped: tuple[tuple[Path, str], ...] = ()


def restore(path: str | Path, lora_template, opt_template,
            check_meta: Callable[[dict[str, Any]], None] | None = None) -> Restored:
    """The newest intact checkpoint at `path` (see `resolve`), shaped like the templates.

    Intact: its files match the manifest, `meta` reads, orbax restores it and every value is finite. A damaged one
    is skipped with a warning naming the bad file, for the next older one; when `path` names one step's directory,
    a damaged one is a CheckpointError instead. `check_meta(meta)` runs before the arrays are read (it raises to
    refuse a checkpoint that does not belong to this run: no fallback then)."""
    root, newest = resolve(path)
    given = Path(path).expanduser().absolute()
    explicit = given == root / str(newest)
    steps = [newest] if explicit else [s for s in _steps(root) if s <= newest]
    skipped: list[tuple[Path, str]] = []
    for step in steps:
        step_dir = root / str(step)
        problem = verify(step_dir)
        if problem is None:
            try:
                meta = read_meta(step_dir)
            except CheckpointError as e:
                problem = str(e)
        if problem is None:
            if check_meta is not None:
                check_meta({**meta, "path": str(step_dir)})
            lora, opt_state, meta = _restore_step(root, step, lora_template, opt_template)
            problem = first_nonfinite({"lora": to_nested(lora), "opt_state": to_nested(opt_state)}, str(step_dir))
            problem = problem and f"{problem} holds NaN or infinite values"
        if problem is None:
            meta["path"] = str(step_dir)
            return Restored(lora, opt_state, meta, step_dir, tuple(skipped))
        if explicit:
            raise CheckpointError(f"checkpoint {step_dir} is damaged: {problem}; resume from an earlier step's "
                                  f"directory or from {root} (the newest intact one)")
        logger.warning("checkpoint %s is damaged (%s); trying the next older one", step_dir, problem)
        skipped.append((step_dir, problem))
    raise CheckpointError(f"no intact checkpoint in {root}: " + "; ".join(p for _, p in skipped)
                          + "; drop resume_from_checkpoint to start from scratch")


def _restore_step(root: Path, step: int, lora_template, opt_template):
    """orbax's restore of a verified checkpoint: its files are as written, so a failure is a setup mismatch."""
    manager = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(create=False))
    try:
        args = ocp.args.Composite(
            lora=ocp.args.StandardRestore(_abstract(to_nested(lora_template))),
            opt_state=ocp.args.StandardRestore(_abstract(to_nested(opt_template))),
            meta=ocp.args.JsonRestore(),
        )
        try:
            out = manager.restore(step, args=args)
        except Exception as e:  # orbax and tensorstore raise many types
            first = str(e).splitlines()[0][:300] if str(e) else ""
            raise CheckpointError(
                f"checkpoint {root / str(step)} does not match this model/LoRA setup ({type(e).__name__}: "
                f"{first}); resume with the lora_r / lora_target_modules / model it was written with") from None
    finally:
        manager.close()
    return from_nested(out["lora"], lora_template), from_nested(out["opt_state"], opt_template), dict(out["meta"])


def discard_after(root: Path, step: int, out: Path) -> list[Path]:
    """Moves checkpoints of steps after `step` (another timeline than the resumed one, or damaged) out of `root`
    into `out/discarded_checkpoints/`, so none of them is taken for this run's; returns where they went."""
    moved = []
    if not root.is_dir():
        return moved
    for s in sorted(int(c.name) for c in root.iterdir() if c.name.isdigit() and int(c.name) > step):
        dest = out / "discarded_checkpoints" / str(s)
        n = 1
        while dest.exists():
            dest, n = out / "discarded_checkpoints" / f"{s}-{n}", n + 1
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(root / str(s), dest)
        moved.append(dest)
    if moved:
        logger.warning("moved %d checkpoint(s) after the resumed step %d to %s: %s", len(moved), step,
                       out / "discarded_checkpoints", ", ".join(p.name for p in moved))
    return moved


def rng_to_json(key: jax.Array) -> list[int]:
    return np.asarray(jax.random.key_data(key)).astype(np.uint32).tolist()


def rng_from_json(data: list[int]) -> jax.Array:
    return jax.random.wrap_key_data(np.asarray(data, dtype=np.uint32))
