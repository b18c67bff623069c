"""What keeps a run's output_dir sound when things go wrong: one writer under racing starts, the adapter
swapped atomically (a kill between steps leaves the old or the new one, never none)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxft.train import TrainConfig
from jaxft.train.guard import LOCK_NAME, OutputDirBusy, OutputDirLock

REPO = Path(__file__).resolve().parents[1]
RACERS = 3  # each imports jaxft (about 2 CPU-s): more racers than cores, so that they race on 2 cores
RACER = """import os, sys, time
from pathlib import Path
from jaxft.train.guard import OutputDirBusy, OutputDirLock
for out in map(Path, sys.argv[1:]):  # one race per directory, every racer in each
    lock = OutputDirLock(out)
    (out / f"ready-{os.getpid()}").touch()
    while len(list(out.glob("ready-*"))) < {racers}:  # a barrier: every racer is here, then all go at once
        time.sleep(0.001)
    try:
        lock.acquire()
    except OutputDirBusy:
        got = False
    else:
        got = True
        (out / f"got-{os.getpid()}").touch()
    (out / f"tried-{os.getpid()}").touch()
    deadline = time.time() + 60
    while got and len(list(out.glob("tried-*"))) < {racers} and time.time() < deadline:
        time.sleep(0.01)  # hold the lock until every racer has tried
    lock.release()
"""


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def test_of_racing_runs_exactly_one_holds_the_lock(tmp_path):
    """The same racers race twice (each start imports jaxft): on an empty output_dir, and on one that holds a killed
    run's lock record (the takeover path)."""
    outs = {left: tmp_path / left for left in ("none", "stale")}
    for out in outs.values():
        out.mkdir()
    (outs["stale"] / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(),
                                                       "started": 0}))
    code = RACER.replace("{racers}", str(RACERS))
    procs = [subprocess.Popen([sys.executable, "-c", code, *map(str, outs.values())], cwd=REPO,
                              stderr=subprocess.PIPE, text=True) for _ in range(RACERS)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    for left, out in outs.items():
        assert len(list(out.glob("tried-*"))) == RACERS, left
        holders = list(out.glob("got-*"))
        assert len(holders) == 1, f"{left}: {len(holders)} of {RACERS} racing runs held the lock at once"
        assert not (out / LOCK_NAME).exists(), left  # released by its holder


def test_lock_dies_with_its_process_and_names_the_live_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
                               "from jaxft.train.guard import OutputDirLock\n"
                               "OutputDirLock(Path(sys.argv[1])).acquire(); print('held', flush=True); time.sleep(600)",
                               str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputDirBusy, match=rf"in use by another jaxft-train run \(pid {holder.pid}\)"):
            OutputDirLock(tmp_path).check()
        with pytest.raises(OutputDirBusy, match=rf"pid {holder.pid}"):
            OutputDirLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = OutputDirLock(tmp_path)  # SIGKILL left the file behind, but not the lock
    assert (tmp_path / LOCK_NAME).exists()
    lock.check()
    lock.acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def _write_adapter(tag: str, files: int = 40):
    def write(d: Path) -> None:
        d.mkdir(parents=True, exist_ok=True)
        for i in range(files):
            (d / f"part{i}.bin").write_bytes(os.urandom(4096))
        (d / "complete").write_text(tag)
    return write


def test_replacing_the_adapter_never_leaves_none(tmp_path):
    from jaxft.train.loop import _export

    out = tmp_path / "out"
    out.mkdir()
    _export(out, "adapter", _write_adapter("0"))
    seen_missing, stop = [], threading.Event()

    def watch():  # a kill may land at any instant: at each, a complete adapter (or its .old copy) must exist
        while not stop.is_set():
            if not any((out / d / "complete").exists() for d in ("adapter", ".adapter.old", "adapter")):
                seen_missing.append(time.monotonic())

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i in range(1, 40):
            _export(out, "adapter", _write_adapter(str(i)))
    finally:
        stop.set()
        watcher.join()
    assert not seen_missing, f"{len(seen_missing)} moments with no complete adapter on disk"
    assert (out / "adapter" / "complete").read_text() == "39"
    assert sorted(p.name for p in out.iterdir()) == ["adapter"], "temporary directories left behind"
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "adapter").stat().st_mode & 0o777 == 0o777 & ~umask


def test_a_run_killed_mid_swap_gets_its_adapter_back(tmp_path):
    from jaxft.train.loop import recover_exports

    out = tmp_path / "out"
    _write_adapter("old", 2)(out / ".adapter.old")  # killed between moving the old one away and the new one in
    _write_adapter("half", 1)(out / ".adapter.new")
    (out / ".adapter.tmp-abc123" / "adapter").mkdir(parents=True)  # an earlier layout's leftover
    (out / "..adapter.new.tmp-x1y2").mkdir()  # the adapter writer's own temporary directory
    recover_exports(out)
    assert (out / "adapter" / "complete").read_text() == "old"
    assert sorted(p.name for p in out.iterdir()) == ["adapter"]
    _write_adapter("older", 2)(out / ".adapter.old")  # killed after the new one was in place
    recover_exports(out)
    assert (out / "adapter" / "complete").read_text() == "old"
    assert sorted(p.name for p in out.iterdir()) == ["adapter"]


# ---------------------------------------------------------------------------------------------- one line, exit 2
def _tiny_run(d: Path, out: Path, **extra) -> TrainConfig:
    from test_train_fixtures import make_jsonl, make_tiny_model

    if not (d / "model").exists():
        make_tiny_model(d / "model")
        make_jsonl(d / "train.jsonl", 20, seed=0)
    return TrainConfig.from_dict(dict(model_name_or_path=str(d / "model"), dataset=str(d / "train.jsonl"),
                                      output_dir=str(out), max_seq_length=64, per_device_train_batch_size=2,
                                      max_steps=2, logging_steps=1, save_steps=2, lora_r=4, bf16=False,
                                      disable_tqdm=True, report_to="none", **extra))


@pytest.mark.skipif(not Path("/sys").is_dir() or os.access("/sys", os.W_OK) and os.geteuid() != 0,
                    reason="needs a read-only directory (sysfs)")
def test_read_only_output_dir_is_refused_before_loading(tmp_path):
    from jaxft.train import TrainConfigError, train

    out = Path("/sys/jaxft-out")
    config = _tiny_run(tmp_path, out)
    start = time.monotonic()
    with pytest.raises(TrainConfigError, match=r"key 'output_dir': cannot write to /sys \("):
        train(config)
    assert time.monotonic() - start < 10, "the check must come before the model and data are loaded"


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (needs root): the out-of-space path of a real file system."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_full_disk_is_one_line_and_keeps_what_was_complete(tmp_path, small_disk):
    from jaxft.train import TrainConfigError, train

    out = small_disk / "out"
    out.mkdir()
    st = os.statvfs(small_disk)
    (small_disk / "filler").write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 48 * 1024))  # 48 KiB left
    with pytest.raises(TrainConfigError, match=r"key 'output_dir': the disk of .* is full \(no space left"):
        train(_tiny_run(tmp_path, out))
    assert not (out / "adapter").exists()
    assert not (out / ".jaxft-train.lock").exists()
