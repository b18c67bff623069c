"""What keeps a run's output_dir safe: one writer at a time, and a clean stop on Ctrl-C / SIGTERM.

`OutputDirLock`: the writer holds an exclusive `flock` on `<output_dir>/.jaxft-train.lock` for its lifetime
(the file also records its host and PID, for the message a refused run prints). The kernel grants the lock to
exactly one process, so of runs started together one gets it and the others are refused with one line, and it
dies with its process: a file left by a killed run is not locked and is taken over with a note. A holder
unlinks the file on release; a run that locked a file another run had just unlinked sees that its descriptor
no longer names the path and tries again.

`StopRequests`: SIGINT and SIGTERM set a flag instead of raising inside a step; the training loop checks
it after each step, writes a checkpoint and raises `TrainingInterrupted`, which the CLI turns into a
resume hint (no traceback). A second signal while stopping falls back to the default behaviour (Ctrl-C
raises KeyboardInterrupt at once): checkpoints are written to a temporary directory and renamed, so
abandoning one mid-write loses only that checkpoint.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

from jaxft.train.config import TrainConfigError

logger = logging.getLogger("jaxft.train")

LOCK_NAME = ".jaxft-train.lock"


class OutputDirBusy(TrainConfigError):
    """Another live run writes to the same output_dir (a bad `output_dir` for this run: the key is named)."""

    def __init__(self, message: str):
        super().__init__(message, key="output_dir")


class TrainingDiverged(TrainConfigError):
    """The loss or gradient norm became NaN / infinite, or the gradients vanished at a positive loss (a saturated
    model): the run stopped before saving or exporting that state. The message names the step and what is kept."""


class TrainingInterrupted(Exception):
    """The run stopped on a signal after writing a checkpoint; `checkpoint` is its path (None if the run
    stopped before its first step)."""

    def __init__(self, signal_name: str, step: int, checkpoint: str | None):
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        where = f"checkpoint of step {step} written to {checkpoint}" if checkpoint else "no step was completed"
        super().__init__(f"stopped by {signal_name} at step {step}; {where}")


def _read_lock(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # empty (a holder between lock and write) or torn


def _try_lock(fd: int, path: Path, tries: int = 1) -> bool:
    """Takes the exclusive lock on `fd`; False when another process holds it through `tries` attempts 50 ms
    apart (a `check` of another starting run holds it for microseconds). A file system without locks warns and
    counts as locked: the run goes on unguarded rather than not at all."""
    for i in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if i + 1 < tries:
                time.sleep(0.05)
        except OSError as e:
            logger.warning("cannot lock %s (%s): this file system has no file locks, so nothing stops a second run "
                           "from writing to the same output_dir", path, e.strerror)
            return True
    return False


class OutputDirLock:
    """Exclusive writer lock on an output directory (see the module docstring)."""

    def __init__(self, output_dir: Path):
        self.path = Path(output_dir) / LOCK_NAME
        self._fd: int | None = None

    def check(self) -> None:
        """Raises OutputDirBusy when another live run holds the lock (without taking it or creating the file)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            if not _try_lock(fd, self.path):
                raise OutputDirBusy(self._busy_message(_read_lock(self.path)))
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(100):
            fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            if not _try_lock(fd, self.path, tries=3):
                info = _read_lock(self.path)
                os.close(fd)
                raise OutputDirBusy(self._busy_message(info))
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous holder unlinked this file after we opened it: lock the new one
                os.close(fd)
                continue
            stale = _read_lock(self.path)
            if stale.get("pid") not in (None, os.getpid()):
                logger.warning("taking over the lock of an earlier run of %s (pid %s, no longer running)",
                               self.path.parent, stale["pid"])
            record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()})
            os.ftruncate(fd, 0)
            os.pwrite(fd, record.encode(), 0)
            self._fd = fd
            return
        raise OutputDirBusy(f"key 'output_dir': could not take {self.path}: other runs keep re-creating it")

    def release(self) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)  # while still locked: a waiter re-checks the path (see acquire)
            os.close(self._fd)
            self._fd = None

    def _busy_message(self, info: dict) -> str:
        host, pid = info.get("host", "?"), info.get("pid", "?")
        where = f" on host {host}" if host not in ("?", socket.gethostname()) else ""
        return (f"key 'output_dir': {str(self.path.parent)!r} is in use by another jaxft-train run{where} "
                f"(pid {pid}); wait for it to finish, stop it, or choose another output_dir")


class StopRequests:
    """Context manager: while active (in the main thread), SIGINT/SIGTERM request a stop instead of killing
    the run. `requested` is the signal's name once one arrived."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame):
        self.requested = signal.Signals(signum).name
        logger.warning("%s received: finishing the current step, then writing a checkpoint (send it again to "
                       "stop at once)", self.requested)
        for s, handler in self._previous.items():  # a second signal acts as it would have without us
            signal.signal(s, handler)

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
