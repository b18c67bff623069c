"""Resume exactness with a real kill: a `jaxft-train` process SIGKILLed after a checkpoint, then resumed with
`--resume`, logs the same per-step losses (and writes the same adapter) as an uninterrupted run (both in-process:
jaxft-train's `main` and `train`, the program the killed process compiled read back from the run's compilation
cache; the kill is what needs a process of its own)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from jaxft.cli import main
from jaxft.train import load_config, read_metrics, train
from test_train_fixtures import make_jsonl, make_tiny_model

REPO = Path(__file__).resolve().parents[1]
STEPS, SAVE = 24, 4


def _cli(config: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxft.cli", str(config), *extra], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _config(d: Path, name: str) -> Path:
    cfg = dict(model_name_or_path=str(d / "model"), dataset=str(d / "train.jsonl"), output_dir=str(d / name),
               max_seq_length=64, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
               logging_steps=1, save_steps=SAVE, save_total_limit=3, learning_rate=5e-3, lr_scheduler_type="cosine",
               warmup_steps=3, lora_r=4, lora_dropout=0.1,  # dropout: the RNG must be restored too
               bf16=True, disable_tqdm=True, report_to="none")
    path = d / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _train_records(out: Path) -> dict[int, dict]:
    records = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), f"duplicate or unordered steps in metrics: {steps}"
    return {r["step"]: r for r in records}


def test_killed_and_resumed_run_matches_uninterrupted_run(tmp_path, capsys):
    make_tiny_model(tmp_path / "model")
    make_jsonl(tmp_path / "train.jsonl", 60, seed=0)
    full_cfg, killed_cfg = _config(tmp_path, "full"), _config(tmp_path, "killed")

    victim = _cli(killed_cfg)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not any("checkpoint" in r for r in read_metrics(metrics)):
        assert victim.poll() is None, f"run ended before its first checkpoint: {victim.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.01)
    assert victim.poll() is None, "the run finished before it could be killed"
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL

    before = _train_records(tmp_path / "killed")
    assert max(before) < STEPS, "the killed run must not have reached the end"
    assert not (tmp_path / "killed" / "adapter").exists()

    assert main([str(killed_cfg), "--resume"]) == 0
    out, err = capsys.readouterr()
    assert "resumed from" in err and "load in PEFT" in out
    train(load_config(full_cfg))

    want, got = _train_records(tmp_path / "full"), _train_records(tmp_path / "killed")
    assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
    for step in want:
        for key in ("loss", "grad_norm", "learning_rate"):
            np.testing.assert_allclose(got[step][key], want[step][key], rtol=1e-6, atol=0,
                                       err_msg=f"step {step} {key}")
    ckpt_steps = [r["step"] for r in read_metrics(tmp_path / "killed" / "metrics.jsonl") if "checkpoint" in r]
    assert ckpt_steps == list(range(SAVE, STEPS + 1, SAVE))
    kept = sorted(int(p.name) for p in (tmp_path / "killed" / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [STEPS - 2 * SAVE, STEPS - SAVE, STEPS]  # save_total_limit=3

    from safetensors.numpy import load_file

    a = load_file(tmp_path / "full" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "killed" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=0, err_msg=k)
