"""What keeps a run's output_dir safe: one writer at a time, and a clean stop on Ctrl-C / SIGTERM.

`OutputDirLock`: `<output_dir>/.jaxft-train.lock` holds the writer's host and PID. It is created with
O_CREAT | O_EXCL, so of two runs started together exactly one gets it; the other is refused with one line.
A lock left by a run that was killed (its PID no longer exists on this host) is taken over with a note.
A lock from another host cannot be checked for liveness and is refused with the command to clear it.

`StopRequests`: SIGINT and SIGTERM set a flag instead of raising inside a step; the training loop checks
it after each step, writes a checkpoint and raises `TrainingInterrupted`, which the CLI turns into a
resume hint (no traceback). A second signal while stopping falls back to the default behaviour (Ctrl-C
raises KeyboardInterrupt at once): checkpoints are written to a temporary directory and renamed, so
abandoning one mid-write loses only that checkpoint.
"""

from __future__ import annotations

import errno
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


class TrainingInterrupted(Exception):
    """The run stopped on a signal after writing a checkpoint; `checkpoint` is its path (None if the run
    stopped before its first step)."""

    def __init__(self, signal_name: str, step: int, checkpoint: str | None):
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        where = f"checkpoint of step {step} written to {checkpoint}" if checkpoint else "no step was completed"
        super().__init__(f"stopped by {signal_name} at step {step}; {where}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM  # exists, owned by someone else
    return True


def _read_lock(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # torn by a kill between create and write: treat as stale


class OutputDirLock:
    """Exclusive writer lock on an output directory (see the module docstring)."""

    def __init__(self, output_dir: Path):
        self.path = Path(output_dir) / LOCK_NAME
        self._held = False

    def holder(self) -> dict | None:
        """The live holder's record, or None when the directory is free (no lock, or a stale one)."""
        if not self.path.exists():
            return None
        info = _read_lock(self.path)
        if not info:
            return None
        if info.get("host") != socket.gethostname():
            return info  # cannot tell whether a PID on another host is alive
        pid = info.get("pid")
        return info if isinstance(pid, int) and _pid_alive(pid) and pid != os.getpid() else None

    def check(self) -> None:
        """Raises OutputDirBusy when another live run holds the lock (without taking it)."""
        info = self.holder()
        if info is not None:
            raise OutputDirBusy(self._busy_message(info))

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()})
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                info = self.holder()
                if info is not None:
                    raise OutputDirBusy(self._busy_message(info)) from None
                stale = _read_lock(self.path)
                logger.warning("taking over the lock of an earlier run of %s (pid %s, no longer running)",
                               self.path.parent, stale.get("pid", "?"))
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(record)
            self._held = True
            return
        raise OutputDirBusy(f"could not take {self.path}: another run keeps re-creating it")

    def release(self) -> None:
        if self._held:
            self.path.unlink(missing_ok=True)
            self._held = False

    def _busy_message(self, info: dict) -> str:
        host, pid = info.get("host", "?"), info.get("pid", "?")
        if host != socket.gethostname():
            return (f"key 'output_dir': {str(self.path.parent)!r} is locked by a run on host {host} (pid {pid}); "
                    f"if that run is gone, delete {self.path}, or choose another output_dir")
        return (f"key 'output_dir': {str(self.path.parent)!r} is in use by another jaxft-train run (pid {pid}); "
                "wait for it to finish, stop it, or choose another output_dir")


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
