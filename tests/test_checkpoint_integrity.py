"""No damaged checkpoint is restored: each file is checked against the manifest written at save time, restored
values must be finite, and a damaged newest checkpoint is named (file and problem) and skipped for the next older
one; a resume that changes what the state means (LoRA settings, model, data) is refused with the keys that differ."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from jaxft.train import TrainConfig, TrainConfigError, read_metrics, train
from jaxft.train import checkpoint as ckpt
from test_train_fixtures import make_jsonl, make_tiny_model

LORA = {"layers": {"q": {"a": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64) / 4096,
                         "b": jnp.ones((64, 8), jnp.float32)}}}
OPT = {"mu": {"layers": {"q": {"a": jnp.zeros((64, 64), jnp.float32)}}}, "count": jnp.array(3, jnp.int32)}


def _meta(step: int) -> dict:
    return {"step": step, "epoch": 0, "step_in_epoch": step, "rng": [0, step]}


def _save(root: Path, steps=(1, 2), lora=LORA, opt=OPT) -> None:
    c = ckpt.Checkpointer(root, save_steps=1)
    for s in steps:
        c.save(s, jax_scale(lora, s), opt, _meta(s), force=True)
    c.close()


def jax_scale(tree, s):
    return {"layers": {"q": {k: v * s for k, v in tree["layers"]["q"].items()}}}


def _largest(d: Path) -> Path:
    return max((p for p in d.rglob("*") if p.is_file() and "/d/" in p.as_posix()), key=lambda p: p.stat().st_size)


def _xor(path: Path, n: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    mid = max(0, len(data) // 2 - n // 2)
    for i in range(mid, min(len(data), mid + n)):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def _damage(step_dir: Path, kind: str) -> str:
    """Damages the checkpoint `kind`'s way; returns the text the problem must name."""
    if kind in ("xor_lora", "xor_opt"):
        f = _largest(step_dir / ("lora" if kind == "xor_lora" else "opt_state"))
        _xor(f)
        return f.name
    if kind == "truncated":
        f = _largest(step_dir / "lora")
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        return f.name
    if kind == "missing":
        f = _largest(step_dir / "opt_state")
        f.unlink()
        return f.name
    if kind == "garbage_meta":
        (step_dir / "meta" / "metadata").write_text("{not json")
        return "metadata"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["xor_lora", "xor_opt", "truncated", "missing", "garbage_meta"])
def test_damaged_newest_checkpoint_is_named_and_skipped(tmp_path, caplog, kind):
    _save(tmp_path)
    named = _damage(tmp_path / "2", kind)
    with caplog.at_level(logging.WARNING, logger="jaxft.train"):
        got = ckpt.restore(tmp_path, LORA, OPT)
    assert got.meta["step"] == 1 and got.path == tmp_path / "1"
    np.testing.assert_array_equal(got.lora["layers"]["q"]["a"], LORA["layers"]["q"]["a"])
    assert [p for p, _ in got.skipped] == [tmp_path / "2"] and named in got.skipped[0][1]
    assert any("checkpoints" not in r.message and named in r.message and "next older" in r.message
               for r in caplog.records), [r.message for r in caplog.records]


def test_a_named_damaged_step_is_refused_naming_the_file(tmp_path):
    _save(tmp_path)
    named = _damage(tmp_path / "2", "xor_lora")
    with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint {tmp_path / '2'} is damaged: .*{named}.*sha256"):
        ckpt.restore(tmp_path / "2", LORA, OPT)


def test_no_intact_checkpoint_is_an_error_listing_each(tmp_path):
    _save(tmp_path)
    a, b = _damage(tmp_path / "2", "xor_lora"), _damage(tmp_path / "1", "truncated")
    with pytest.raises(ckpt.CheckpointError, match=rf"no intact checkpoint in {tmp_path}: .*{a}.*{b}"):
        ckpt.restore(tmp_path, LORA, OPT)


def test_non_finite_values_are_never_restored(tmp_path):
    bad = {"layers": {"q": {"a": LORA["layers"]["q"]["a"].at[3, 5].set(jnp.nan), "b": LORA["layers"]["q"]["b"]}}}
    _save(tmp_path, steps=(1,))
    _save(tmp_path, steps=(2,), lora=bad)  # a manifest that matches: the values themselves are wrong
    got = ckpt.restore(tmp_path, LORA, OPT)
    assert got.meta["step"] == 1
    assert "lora/layers/q/a holds NaN or infinite values" in got.skipped[0][1]


def test_a_checkpoint_without_manifest_is_not_trusted(tmp_path):
    """Bytes flipped in the array data restore as finite garbage: without the manifest nothing can tell, so a
    checkpoint without one (killed before it was written, or an older jaxft's) is skipped."""
    _save(tmp_path)
    (tmp_path / "2" / ckpt.MANIFEST).unlink()
    _xor(_largest(tmp_path / "2" / "lora"))
    got = ckpt.restore(tmp_path, LORA, OPT)
    assert got.meta["step"] == 1 and f"{ckpt.MANIFEST} is missing" in got.skipped[0][1]
    (tmp_path / "1" / ckpt.MANIFEST).unlink()
    with pytest.raises(ckpt.CheckpointError, match="no intact checkpoint"):
        ckpt.restore(tmp_path, LORA, OPT)


def test_manifest_covers_every_file(tmp_path):
    _save(tmp_path, steps=(1,))
    files = json.loads((tmp_path / "1" / ckpt.MANIFEST).read_text())["files"]
    on_disk = {p.relative_to(tmp_path / "1").as_posix() for p in (tmp_path / "1").rglob("*")
               if p.is_file() and p.name != ckpt.MANIFEST}
    assert set(files) == on_disk and all(len(v["sha256"]) == 64 for v in files.values())
