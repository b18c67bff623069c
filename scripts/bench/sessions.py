"""Worker processes of the training benchmark: one-shot subprocesses and task sessions.

A session is one worker process (`python -m <module>`) running a list of tasks in order (worker_common). The
worker rewrites its result file, a JSON list, after every task; ``run_session`` polls that file,
hands each new result to a callback as soon as it appears (so the harness can save its report
after every task, even if the harness itself is cut short), and kills the worker when no task has
finished for ``task_timeout_s`` or the deadline passes. ``SessionRunner.run`` chains sessions:
when one dies (timeout, crash, an OOM that killed the process), the task it died in is recorded
as timeout/oom/crashed and a new session starts with the tasks after it, so one crash costs one
task, not the rest of the session.

``run_jobs`` runs a queue of such session chains: one after another (the serial path), or up to one
per GPU at once, each worker pinned to its GPU through CUDA_VISIBLE_DEVICES (the multi-GPU path).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from .worker_common import Task, dump_session, is_oom_message

LOG_KEEP_BYTES = 200_000
POLL_S = 0.5
OnResult = Callable[[Task, dict[str, Any]], None]


def _popen(cmd: list[str], run_dir: str, env: dict[str, str]):
    os.makedirs(run_dir, exist_ok=True)
    fo = open(os.path.join(run_dir, "stdout.log"), "w")
    fe = open(os.path.join(run_dir, "stderr.log"), "w")
    # Its own process group: a timeout kills the worker and every child it started.
    proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=fo, stderr=fe, start_new_session=True)
    return proc, (fo, fe)


def _kill(proc: subprocess.Popen) -> int:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.wait()


def _stderr_tail(run_dir: str, n: int = 3000) -> str:
    path = os.path.join(run_dir, "stderr.log")
    if not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - n))
        return f.read().decode(errors="replace")


def _died(rc: int | None, killed_why: str | None, run_dir: str, wall: float) -> dict[str, Any]:
    """The record of a task whose worker ended without writing its result."""
    err_tail = _stderr_tail(run_dir)
    if killed_why is not None:
        status, error = "timeout", killed_why
    else:
        status = "oom" if is_oom_message(err_tail) else "crashed"
        error = f"exit code {rc} without a result; stderr tail: {err_tail[-600:]}"
    return {"status": status, "error": error, "stderr_tail": err_tail, "wall_s": wall}


def run_subprocess(cmd: list[str], run_dir: str, out_path: str, timeout_s: float,
                   env: dict[str, str]) -> dict[str, Any]:
    """Run one single-result process; return its result JSON, or a timeout/crash record."""
    t0 = time.perf_counter()
    proc, files = _popen(cmd, run_dir, env)
    killed_why = None
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc, killed_why = _kill(proc), f"killed after {timeout_s:.0f} s"
    for f in files:
        f.close()
    wall = time.perf_counter() - t0
    if killed_why is None and os.path.exists(out_path):
        with open(out_path) as f:
            return {**json.load(f), "wall_s": wall}
    return _died(rc, killed_why, run_dir, wall)


def _read_results(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError):  # not written yet (the worker replaces it atomically)
        return []
    return raw if isinstance(raw, list) else []


def run_session(cmd: list[str], tasks: list[Task], run_dir: str, env: dict[str, str],
                task_timeout_s: float, deadline: float,
                on_result: Callable[[int, dict[str, Any]], None]) -> tuple[int, dict[str, Any] | None]:
    """Run ``cmd + [--task TASKS --out RESULTS]`` on ``tasks``; ``deadline`` is a perf_counter time.

    Returns (number of tasks finished, None) when the worker finished them all, else (finished,
    the record of the task it died in). ``on_result(index, raw)`` is called once per finished task.
    """
    os.makedirs(run_dir, exist_ok=True)
    task_path, out = os.path.join(run_dir, "tasks.json"), os.path.join(run_dir, "results.json")
    dump_session(tasks, task_path)
    if os.path.exists(out):
        os.remove(out)
    proc, files = _popen(cmd + ["--task", task_path, "--out", out], run_dir, env)
    seen, last = 0, time.perf_counter()

    def collect() -> None:
        nonlocal seen, last
        results = _read_results(out)
        for i in range(seen, min(len(results), len(tasks))):
            on_result(i, results[i])
            seen, last = i + 1, time.perf_counter()

    killed_why, rc = None, None
    while rc is None:
        try:
            rc = proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            collect()
            now = time.perf_counter()
            if now - last > task_timeout_s:
                killed_why = f"session killed: no task finished within {task_timeout_s:.0f} s"
            elif now > deadline:
                killed_why = "session killed at the time budget's end"
            if killed_why:
                rc = _kill(proc)
    for f in files:
        f.close()
    collect()
    if seen >= len(tasks):
        return seen, None
    return seen, _died(rc, killed_why, run_dir, time.perf_counter() - last)


def keep_logs(run_dir: str, logs_dir: str | None) -> None:
    """Copy a run's stdout/stderr (last LOG_KEEP_BYTES of each) and task file into logs_dir."""
    if not logs_dir:
        return
    dest = os.path.join(logs_dir, os.path.basename(run_dir))
    os.makedirs(dest, exist_ok=True)
    for name in ("stdout.log", "stderr.log", "tasks.json"):
        src = os.path.join(run_dir, name)
        if os.path.exists(src):
            with open(src, "rb") as f:
                f.seek(max(0, os.path.getsize(src) - LOG_KEEP_BYTES))
                data = f.read()
            with open(os.path.join(dest, name), "wb") as f:
                f.write(data)


@dataclasses.dataclass
class SessionRunner:
    """Runs task lists as chained sessions of one worker module (see the module docstring)."""

    workdir: str                       # one subfolder per session
    task_timeout_s: float              # kill a session when no task finished for this long
    time_left: Callable[[], float]     # seconds sessions may still use (budget minus report reserve)
    min_start_s: float                 # do not start a session with less time than this left
    logs_dir: str | None = None
    python: str = sys.executable

    def run(self, name: str, module: str, tasks: list[Task], env_for: Callable[[str], dict[str, str]],
            on_result: OnResult) -> None:
        """Every task gets exactly one ``on_result(task, raw)``; raw["session"] names its session.

        The worker runs as ``python -m module`` in its run folder: ``env_for(run_dir)`` builds its environment,
        whose PYTHONPATH must find ``module``. Tasks no session could start for
        (budget) are recorded as "skipped".
        """
        todo, part = list(tasks), 0
        while todo:
            left = self.time_left()
            if left < self.min_start_s:
                for task in todo:
                    on_result(task, {"status": "skipped", "error": "time budget exhausted", "session": None})
                return
            session = name if part == 0 else f"{name}.{part}"
            run_dir = os.path.join(self.workdir, session)
            batch = todo
            finished, death = run_session(
                [self.python, "-m", module], batch, run_dir, env_for(run_dir), self.task_timeout_s,
                time.perf_counter() + left,
                lambda i, raw: on_result(batch[i], {**raw, "session": session}))
            keep_logs(run_dir, self.logs_dir)
            if death is None:
                return
            print(f"[bench] session {session} died in task {finished + 1}/{len(batch)} "
                  f"({batch[finished].system} {batch[finished].workload}): {death['status']}", flush=True)
            on_result(batch[finished], {**death, "session": session})
            todo, part = batch[finished + 1:], part + 1


@dataclasses.dataclass(frozen=True)
class Job:
    """One queued session chain: the arguments of ``SessionRunner.run``."""

    name: str
    module: str
    tasks: list[Task]
    env_for: Callable[[str], dict[str, str]]
    on_result: OnResult


def pin_env(env: dict[str, str], gpu: int | None) -> dict[str, str]:
    """``env`` with CUDA_VISIBLE_DEVICES=<gpu>: JAX and torch in that process see that one device
    (as their device 0). ``gpu=None`` leaves env as it is."""
    return env if gpu is None else {**env, "CUDA_VISIBLE_DEVICES": str(gpu)}


def run_jobs(runner: SessionRunner, jobs: list[Job], gpus: list[int] | None) -> None:
    """Run ``jobs`` in queue order; every task still gets exactly one ``on_result``.

    ``gpus=None``: one after another in this thread, environments untouched (the serial path).
    Otherwise up to ``len(gpus)`` chains at once, one per GPU: each job starts, in queue order, on
    the next GPU that is free (at first gpus[0], gpus[1], ...), its workers pinned there by
    CUDA_VISIBLE_DEVICES; a session that dies is continued on the same GPU (SessionRunner.run).
    ``raw["gpu"]`` is the GPU index a task ran on (None for a task no session started for). The
    ``on_result`` calls are serialised by a lock (they never overlap), so a callback may rewrite a
    shared report. Budget and deadlines are the runner's: a chain that starts after the budget is
    spent records its tasks as skipped, a running one is killed at the deadline.
    """
    if gpus is None:
        for job in jobs:
            runner.run(job.name, job.module, job.tasks, job.env_for, job.on_result)
        return
    if not gpus:
        raise ValueError("run_jobs: gpus is an empty list; pass None for the serial path")
    lock = threading.Lock()
    free: queue.Queue[int] = queue.Queue()
    for gpu in gpus:
        free.put(gpu)
    failures: list[BaseException] = []

    def work(job: Job, gpu: int) -> None:
        def on_result(task: Task, raw: dict[str, Any]) -> None:
            with lock:
                job.on_result(task, {**raw, "gpu": gpu if raw.get("session") is not None else None})

        try:
            runner.run(job.name, job.module, job.tasks, lambda run_dir: pin_env(job.env_for(run_dir), gpu),
                       on_result)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread after the join
            failures.append(exc)
        finally:
            free.put(gpu)

    threads = []
    for job in jobs:
        gpu = free.get()  # blocks until a running chain hands its GPU back
        print(f"[bench] session {job.name} starts on GPU {gpu}", flush=True)
        thread = threading.Thread(target=work, args=(job, gpu), name=f"bench-{job.name}", daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
