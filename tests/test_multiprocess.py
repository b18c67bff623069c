"""Two processes on localhost, one run: `jax.distributed` over CPU collectives (gloo), 2 host devices each.

A `jaxft-train` run on mesh data=2 x fsdp=2 over the 4 devices of 2 processes is SIGKILLed after a checkpoint and
resumed, and logs the losses of one process on one device (jaxft-train's `train` in-process; a mesh against one
device is test_sharding's); the resumed processes first pack only their rows of a few global batches, which
together make the one-process batch; only process 0 writes files of its own (every process's writes under
output_dir, checkpoints aside, are recorded by tests/multiprocess_worker.py's audit hook). The `distributed` key's
validation runs in-process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxft.distributed import DistributedConfig, DistributedConfigError, initialize
from jaxft.train import TrainConfigError, load_config, read_metrics, train
from test_train_fixtures import make_jsonl, make_tiny_model

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "multiprocess_worker.py"
STEPS, SAVE = 12, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXFT_")}
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    return dict(env, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", **extra)  # conftest's flags kept


def _two_processes(*args: str) -> list[subprocess.Popen]:
    """Processes 0 and 1 of a 2-process run (2 CPU devices each) running the worker with `args`, where
    `{i}` in an argument becomes the process id."""
    port = _free_port()
    return [subprocess.Popen([sys.executable, str(WORKER), *(a.replace("{i}", str(i)) for a in args)], cwd=REPO,
                             env=_env(2, JAXFT_COORDINATOR=f"127.0.0.1:{port}", JAXFT_NUM_PROCESSES="2",
                                      JAXFT_PROCESS_ID=str(i)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]


def _finish(procs: list[subprocess.Popen], timeout: int = 600) -> None:
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"process {i}: {err[-3000:]}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("multiprocess")
    make_tiny_model(d / "model")
    make_jsonl(d / "train.jsonl", 60, seed=0)
    return d


# ------------------------------------------------------------------------------------------------ config


def test_distributed_key_explicit_env_and_auto(tmp_path):
    assert DistributedConfig.from_value(None, {}) == DistributedConfig()  # one process
    env = {"JAXFT_COORDINATOR": "node1:1234", "JAXFT_NUM_PROCESSES": "4", "JAXFT_PROCESS_ID": "3"}
    assert DistributedConfig.from_value(None, env) == DistributedConfig("explicit", "node1:1234", 4, 3)
    assert DistributedConfig.from_value({"process_id": 1}, env).process_id == 1  # the key wins over the env
    assert DistributedConfig.from_value("off", env) == DistributedConfig()
    assert DistributedConfig.from_value("auto", env).mode == "auto"
    with pytest.raises(DistributedConfigError, match="process_id is missing; give it in the mapping or set "
                                                     "JAXFT_PROCESS_ID"):
        DistributedConfig.from_value({"coordinator_address": "h:1", "num_processes": 2}, {})
    with pytest.raises(DistributedConfigError, match=r"process_id=2 must be in \[0, 1\]"):
        DistributedConfig.from_value({"coordinator_address": "h:1", "num_processes": 2, "process_id": 2}, {})
    with pytest.raises(DistributedConfigError, match="coordinator_address='node1' must be HOST:PORT"):
        DistributedConfig.from_value({"coordinator_address": "node1"}, env)
    with pytest.raises(DistributedConfigError, match="JAXFT_NUM_PROCESSES='two' must be an integer"):
        DistributedConfig.from_value(None, dict(env, JAXFT_NUM_PROCESSES="two"))
    with pytest.raises(DistributedConfigError, match="unknown key 'rank'"):
        DistributedConfig.from_value({"rank": 0}, {})
    # auto outside a multi-process launch, and one explicit process: nothing is joined
    assert not initialize(DistributedConfig(mode="auto"), {})
    assert not initialize(DistributedConfig(mode="auto"), {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1",
                                                           "SLURM_PROCID": "0"})
    assert not initialize(DistributedConfig("explicit", "localhost:1", 1, 0))

    make_tiny_model(tmp_path / "model")
    make_jsonl(tmp_path / "train.jsonl", 4)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(dict(model_name_or_path=str(tmp_path / "model"), output_dir=str(tmp_path / "o"),
                                        dataset=str(tmp_path / "train.jsonl"))) + "distributed: {num_processes: 0}\n")
    with pytest.raises(TrainConfigError, match=rf"^{path}:4: key 'distributed': coordinator_address is missing"):
        load_config(path)
    assert load_config(path, ["distributed=auto"]).distributed_config.mode == "auto"


# ------------------------------------------------------------------------------------------------ 2 processes


def _config(d: Path, name: str, **changes) -> Path:
    cfg = dict(model_name_or_path=str(d / "model"), dataset=str(d / "train.jsonl"), output_dir=str(d / name),
               max_seq_length=64, per_device_train_batch_size=1, max_steps=STEPS, logging_steps=1, save_steps=SAVE,
               learning_rate=5e-3, lr_scheduler_type="cosine", warmup_steps=1, lora_r=4, seed=0, bf16=False,
               disable_tqdm=True, report_to="none", remat="none", layer_loop="scan", mesh={"data": 2, "fsdp": 2},
               save_merged_model=True)
    path = d / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**cfg, **changes}), encoding="utf-8")
    return path


def _writes(path: Path) -> list[str]:
    import json

    return [json.loads(line)["path"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def runs(workdir):
    """The 2-process run, killed after its first checkpoint and resumed (the resumed processes pack their rows of
    a few batches first); the one-process reference on one device (4 rows a step, as 4 devices x 1) meanwhile."""
    config, out = _config(workdir, "two"), workdir / "two"
    procs = _two_processes("train", str(workdir / "writes{i}.jsonl"), str(config))
    deadline = time.monotonic() + 400
    while not any("checkpoint" in r for r in read_metrics(out / "metrics.jsonl")):
        for i, p in enumerate(procs):
            assert p.poll() is None, f"process {i} ended before its first checkpoint: {p.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint within 400 s"
        time.sleep(0.01)
    assert all(p.poll() is None for p in procs), "the run finished before it could be killed"
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait()
    before = {r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r}
    assert max(before) < STEPS and not (out / "adapter").exists()

    resumed = _two_processes("train", str(workdir / "resumed_writes{i}.jsonl"), str(config),
                             f"--batches={workdir / 'p{i}.npz'}", "--resume")
    try:
        # (its checkpoints are not read: one, at the end, instead of one every SAVE steps)
        train(load_config(_config(workdir, "one", mesh=None, per_device_train_batch_size=4, save_steps=STEPS)))
    finally:
        _finish(resumed)
    return workdir


def test_each_process_packs_its_rows_and_together_they_make_the_one_process_batch(runs):
    from jaxft.data.pipeline import DataConfig, build_datasets
    from jaxft.train.step import stack_micro_batches

    parts = [np.load(runs / f"p{i}.npz") for i in range(2)]
    assert [int(p["process"]) for p in parts] == [0, 1]
    one, _ = build_datasets(DataConfig(path=str(runs / "train.jsonl"), max_seq_length=64, batch_size=8, seed=0),
                            str(runs / "model"))
    for step in (0, 5, 13):
        full = one.batch(step)
        slots = [p[f"slots_{step}"] for p in parts]
        # data=2 x fsdp=2, 2 devices per process, 2 micro-batches of 4 rows: process 0 holds row shards 0, 1
        assert [s.tolist() for s in slots] == [[0, 1, 4, 5], [2, 3, 6, 7]]
        order = np.argsort(np.concatenate(slots))
        for key, value in full.items():
            joined = np.concatenate([p[f"local_{step}_{key}"] for p in parts])[order]
            np.testing.assert_array_equal(joined, value, err_msg=f"step {step} {key}")
            for p in parts:  # the global device batch both processes made is the one-process batch
                np.testing.assert_array_equal(p[f"global_{step}_{key}"], stack_micro_batches(full, 2)[key])
        assert full["segment_ids"].any() and one.num_tokens(step) == np.count_nonzero(full["segment_ids"])


@pytest.mark.slow
def test_two_processes_train_like_one_and_resume_after_a_kill(runs):
    from safetensors.numpy import load_file

    workdir, out = runs, runs / "two"

    def losses(name):
        return {r["step"]: r["loss"] for r in read_metrics(workdir / name / "metrics.jsonl") if "loss" in r}
    want, got = losses("one"), losses("two")
    assert sorted(want) == sorted(got) == list(range(1, STEPS + 1))
    assert want[STEPS] < want[1]  # it trains
    np.testing.assert_allclose([got[s] for s in want], list(want.values()), rtol=1e-5)

    for sub, name in (("adapter", "adapter_model.safetensors"), ("merged", "model.safetensors")):
        a, b = load_file(workdir / "one" / sub / name), load_file(out / sub / name)
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=f"{sub} {k}")

    # process 1 wrote nothing outside checkpoints/, in either run; process 0 wrote the metrics and exports
    assert _writes(workdir / "writes1.jsonl") == [] and _writes(workdir / "resumed_writes1.jsonl") == []
    first, resumed = _writes(workdir / "writes0.jsonl"), _writes(workdir / "resumed_writes0.jsonl")
    assert "metrics.jsonl" in first and "train_config.json" in first
    assert "metrics.jsonl" in resumed and any(p.endswith("adapter_config.json") for p in resumed)
    assert (out / "merged" / "config.json").exists() and (out / "adapter" / "adapter_config.json").exists()
