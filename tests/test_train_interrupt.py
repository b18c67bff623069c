"""Ctrl-C / SIGTERM end a run with a checkpoint and a resume hint (no traceback); one writer per output_dir."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from jaxft.train import TrainConfig, TrainConfigError, read_metrics, train
from jaxft.train.guard import LOCK_NAME
from test_train_fixtures import make_jsonl, make_tiny_model

REPO = Path(__file__).resolve().parents[1]
STEPS = 400  # far more than the test lets run: the signal always arrives mid-run


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("interrupt")
    make_tiny_model(d / "model")
    make_jsonl(d / "train.jsonl", 60, seed=0)
    return d


def _config(d: Path, name: str, **extra) -> Path:
    cfg = dict(model_name_or_path=str(d / "model"), dataset=str(d / "train.jsonl"), output_dir=str(d / name),
               max_seq_length=64, per_device_train_batch_size=2, max_steps=STEPS, logging_steps=1, save_steps=1000,
               lora_r=4, bf16=False, disable_tqdm=True, report_to="none",
               lr_scheduler_type="constant", **extra)  # the 2-step run compiles the 400-step runs' step: a cache hit
    path = d / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _start(config: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxft.cli", str(config), *extra], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_steps(proc: subprocess.Popen, metrics: Path, n: int = 3) -> None:
    deadline = time.monotonic() + 300
    while sum("loss" in r for r in read_metrics(metrics)) < n:
        assert proc.poll() is None, f"run ended early: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "no training steps within 300 s"
        time.sleep(0.02)


def _stop(proc: subprocess.Popen, d: Path, name: str, sig: signal.Signals, after: int) -> tuple[int, list[str]]:
    """Send `sig` once the run has logged 3 steps past `after`; the run must end with a checkpoint and a one-line
    hint (no traceback). Returns the stop's step and the printed command."""
    metrics = d / name / "metrics.jsonl"
    _wait_for_steps(proc, metrics, sum("loss" in r for r in read_metrics(metrics)) + 3)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig.value, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert f"stopped by {sig.name}" in last and "--resume" in last, last
    ckpts = [r for r in read_metrics(metrics) if "checkpoint" in r and r["step"] > after]
    assert len(ckpts) == 1 and Path(ckpts[0]["checkpoint"]).is_dir(), ckpts  # save_steps=1000: only the stop's
    stopped_at = ckpts[0]["step"]
    assert after + 3 <= stopped_at < STEPS and f"at step {stopped_at}" in last
    assert not (d / name / LOCK_NAME).exists(), "the lock must be released on the way out"
    command = last.split("continue with: ", 1)[1].split()
    assert command[0] == "jaxft-train" and command[-1] == "--resume"
    return stopped_at, command


def test_signals_write_a_checkpoint_and_print_the_resume_command(workdir):
    """A second run on the output_dir of a running one is refused; Ctrl-C stops the running one; the printed command
    continues it from that step; SIGTERM stops the resumed run."""
    name = "stop"
    config = _config(workdir, name)
    proc = _start(config)
    try:
        _wait_for_steps(proc, workdir / name / "metrics.jsonl", n=1)
        cfg = TrainConfig.from_dict({**yaml.safe_load(config.read_text()), "overwrite_output_dir": True})
        with pytest.raises(TrainConfigError, match=rf"in use by another jaxft-train run \(pid {proc.pid}\)"):
            train(cfg)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    stopped_at, command = _stop(proc, workdir, name, signal.SIGINT, 0)
    resumed = _start(Path(command[1]), *command[2:-1], "--resume")
    stopped_again, _ = _stop(resumed, workdir, name, signal.SIGTERM, stopped_at)
    steps = [r["step"] for r in read_metrics(workdir / name / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, stopped_again + 1)), steps  # from where it stopped: no step redone or skipped


def test_lock_of_a_killed_run_is_taken_over_with_a_note(workdir, caplog):
    out = workdir / "stale"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its PID now names no process
    (out / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": 0}))
    cfg = TrainConfig.from_dict({**yaml.safe_load(_config(workdir, "stale").read_text()), "max_steps": 2})
    with caplog.at_level("WARNING", logger="jaxft.train"):
        result = train(cfg)
    assert result.global_step == 2
    assert any("taking over the lock" in r.message and str(dead.pid) in r.message for r in caplog.records)
    assert not (out / LOCK_NAME).exists(), "a run that ends normally releases its lock"
