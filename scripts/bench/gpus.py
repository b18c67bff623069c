"""The host's GPUs for the training benchmark (scripts.bench.train): what nvidia-smi lists (or fake ones, for
tests), --gpus resolved to the indices sessions are pinned to, and the GPU a serial worker runs on."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess

FAKE_GPUS_ENV = "BENCH_FAKE_GPUS"  # tests: pretend nvidia-smi lists this many GPUs (read by discover_gpus only)


def discover_gpus() -> list[tuple[int, str]]:
    """(index, "name, memory") of every GPU nvidia-smi lists; [] when there is none.

    The environment variable BENCH_FAKE_GPUS=K replaces the list with K fake GPUs, so the
    multi-GPU scheduling can be tested on a machine without any (the workers then run on the CPU,
    each still given its CUDA_VISIBLE_DEVICES).
    """
    fake = os.environ.get(FAKE_GPUS_ENV)
    if fake:
        if not fake.isdigit() or int(fake) < 1:
            raise SystemExit(f"{FAKE_GPUS_ENV}={fake!r} must be a positive integer (the number of fake GPUs)")
        return [(i, f"fake GPU {i} ({FAKE_GPUS_ENV})") for i in range(int(fake))]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = []
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        index, _, rest = line.partition(",")
        if index.strip().isdigit():
            gpus.append((int(index), rest.strip()))
    return gpus


def resolve_gpus(spec: str, p: argparse.ArgumentParser) -> tuple[list[int] | None, list[str] | None]:
    """--gpus N|all -> (GPU indices to pin sessions to, their names), or (None, None) for the
    serial path (N == 1: the workers' environment is left as it is, exactly as before --gpus)."""
    if spec == "1":
        return None, None
    if spec != "all" and not (spec.isdigit() and int(spec) >= 1):
        p.error(f"--gpus {spec!r}: give a positive number of GPUs or 'all'")
    gpus = discover_gpus()
    want = len(gpus) if spec == "all" else int(spec)
    if want > len(gpus) or not gpus:
        p.error(f"--gpus {spec}: nvidia-smi lists {len(gpus)} GPU(s) on this host"
                + (f" ({'; '.join(f'{i}: {n}' for i, n in gpus)})" if gpus else "")
                + "; ask for at most that many (or use --gpus 1)")
    if want == 1:
        return None, None
    return [i for i, _ in gpus[:want]], [f"{i}: {n}" for i, n in gpus[:want]]


def _serial_gpu(device: str) -> int | str | None:
    """The GPU a serial (--gpus 1) worker runs on: the first one CUDA_VISIBLE_DEVICES names, else 0."""
    if device != "cuda":
        return None
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if not first:
        return 0
    return int(first) if first.isdigit() else first



def _gpu_name() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return lines[0] if out.returncode == 0 and lines else None
