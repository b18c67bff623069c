"""No damaged checkpoint is restored: each file is checked against the manifest written at save time, restored
values must be finite, and a damaged newest checkpoint is named (file and problem) and skipped for the next older
one; a resume that changes what the state means (LoRA settings, model, data) is refused with the keys that differ."""

from __future__ import annotations

import json
import logging
import os
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


# ---------------------------------------------------------------------------------------------- through a run


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4 and an adapter. A constant rate: the resumed runs
    of another max_steps compile the same step (a cache hit)."""
    d = tmp_path_factory.mktemp("integrity")
    make_tiny_model(d / "model")
    make_jsonl(d / "train.jsonl", 40, seed=0)
    values = dict(model_name_or_path=str(d / "model"), dataset=str(d / "train.jsonl"), output_dir=str(d / "base"),
                  max_seq_length=64, per_device_train_batch_size=2, max_steps=4, logging_steps=1, save_steps=2,
                  lora_r=4, lora_alpha=16, learning_rate=5e-3, lr_scheduler_type="constant", bf16=False,
                  disable_tqdm=True, report_to="none")
    train(TrainConfig.from_dict(values))
    return d, values


def _copy(base, name: str, **changes) -> tuple[Path, TrainConfig]:
    d, values = base
    out = d / name
    shutil.copytree(d / "base", out)
    return out, TrainConfig.from_dict({**values, "output_dir": str(out), **changes})


def test_exported_adapter_has_normal_permissions(base):
    umask = os.umask(0o22)
    os.umask(umask)
    adapter = base[0] / "base" / "adapter"
    assert adapter.stat().st_mode & 0o777 == 0o777 & ~umask
    for f in adapter.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f
    assert sorted(p.name for p in adapter.parent.iterdir() if p.name.startswith(".")) == []


def test_resume_skips_a_damaged_newest_checkpoint_and_replaces_it(base, caplog):
    out, config = _copy(base, "fallback", resume_from_checkpoint=True)
    named = _damage(out / "checkpoints" / "4", "xor_opt")
    with caplog.at_level(logging.WARNING, logger="jaxft.train"):
        result = train(config)
    assert result.resumed_from == str(out / "checkpoints" / "2") and result.global_step == 4
    assert any(named in r.message and "next older" in r.message for r in caplog.records)
    assert (out / "discarded_checkpoints" / "4").is_dir(), "the damaged checkpoint must not stay as the latest"
    assert ckpt.verify(out / "checkpoints" / "4") is None, "step 4 is written anew, not kept from before"
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "checkpoint" in r] == [2, 4]


def test_resume_from_an_earlier_step_moves_later_checkpoints_aside(base):
    out, config = _copy(base, "earlier", resume_from_checkpoint=str(base[0] / "base" / "checkpoints" / "2"),
                        max_steps=3)
    before = (out / "checkpoints" / "4" / ckpt.MANIFEST).read_bytes()
    assert train(config).global_step == 3
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "3"]
    assert (out / "discarded_checkpoints" / "4" / ckpt.MANIFEST).read_bytes() == before


def test_cli_names_the_damaged_file_of_a_named_step_in_one_line(base, capsys):
    from jaxft.cli import main

    out, config = _copy(base, "named")
    named = _damage(out / "checkpoints" / "4", "truncated")
    path = out / "run.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    rc = main([str(path), f"--resume={out / 'checkpoints' / '4'}"])
    err = capsys.readouterr().err
    assert rc == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("jaxft-train: error:") and named in last, last
    assert "bytes, the manifest says" in last


@pytest.mark.parametrize("change, named", [
    ({"lora_alpha": 32}, "lora_alpha: 16.0 -> 32.0"),
    ({"dataset": "swapped"}, "data: "),
])
def test_resume_that_changes_what_the_state_means_is_refused(base, change, named):
    if change.get("dataset") == "swapped":  # the same lengths, so the same row count: other text
        src = (base[0] / "train.jsonl").read_text()
        swapped = base[0] / "swapped.jsonl"
        swapped.write_text(src.replace("cat", "dog").replace("sun", "red"))
        change = {"dataset": str(swapped)}
    out, config = _copy(base, f"changed_{next(iter(change))}", resume_from_checkpoint=True, max_steps=6, **change)
    with pytest.raises(TrainConfigError, match=rf"written for another setup \(.*{named}"):
        train(config)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "4"]


def _strict(line: str):
    def refuse(name):
        raise AssertionError(f"metrics.jsonl holds {name}, which is not JSON: {line}")
    return json.loads(line, parse_constant=refuse)


@pytest.mark.parametrize("lr, why", [(1e30, "the loss is nan"), (1e6, "the gradients are exactly zero")])
def test_a_diverged_run_stops_and_keeps_the_good_state(base, lr, why):
    out, config = _copy(base, f"diverged_{lr:g}", resume_from_checkpoint=True, max_steps=8, learning_rate=lr)
    adapter = (out / "adapter" / "adapter_model.safetensors").read_bytes()
    with pytest.raises(TrainConfigError, match=rf"training stopped: {why}.* at step \d+.*; lower learning_rate"):
        train(config)
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == adapter, "the good adapter was replaced"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2", "4"], "a diverged state was saved"
    records = [_strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if lr == 1e30:
        assert any(r.get("loss", 0) is None for r in records)


@pytest.mark.parametrize("other, says", [({"hidden": 48}, "do not fit this model's"),
                                         ({"layers": 1}, "model does not have or adapter_config.json does not target")])
def test_generate_with_an_adapter_of_another_base_is_one_line(base, capsys, other, says):
    from jaxft.generate_cli import main

    d = base[0]
    model = make_tiny_model(d / f"other_{next(iter(other))}", **other)
    assert main([str(model), "--adapter", str(d / "base" / "adapter"), "--prompt", "cat dog"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("jaxft-generate: error:") and says in err[-1], err[-3:]


def test_nan_in_an_adapter_is_named_on_load(base, caplog):
    import jaxft
    from safetensors.numpy import load_file, save_file

    d = base[0]
    bad = d / "nan_adapter"
    shutil.copytree(d / "base" / "adapter", bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    name = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[name][0, 0] = np.nan
    save_file(tensors, bad / "adapter_model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="jaxft.lora"):
        jaxft.load_adapter(jaxft.from_pretrained(d / "model", dtype="float32"), bad)
    key = name.removeprefix("base_model.model.").removesuffix(".lora_B.weight")
    assert any(key in r.message and "NaN" in r.message for r in caplog.records), [r.message for r in caplog.records]
