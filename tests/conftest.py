"""Shared test setup: CPU by default, `gpu`-marked tests only where a GPU is present."""

import atexit
import gc
import importlib.util
import os
import shutil
import tempfile

import pytest

# Tests compare against fp32 torch: keep XLA's CPU matmuls at full precision.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# One OpenMP thread for torch (and bitsandbytes) in each worker and child process: `make test` runs two workers on
# two cores, and torch's threads spin-waiting for a core the other worker holds took up to 10x the CPU time of one
# thread on the oracles' tiny models.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Without a CUDA plugin, LLVM's passes over XLA's CPU code at -O0 (child processes inherit it: test_train_fixtures'
# host_devices_env keeps it): the tests' programs are tiny, so compiling them is most of the suite's time, and -O0
# takes about a third off it; the HLO the tests read (fusions, buffers, placements) is made before LLVM and is the
# same, and without fast-math LLVM reassociates no float sums (the losses of test_remat's programs came out equal).
# A run's compiled programs are shared by its workers and child processes through JAX's compilation cache in a
# folder of this run (made by the first process, removed at its end): many tests compile the same tiny step (the
# jaxft-train runs, a killed run and its resume, a variant and its base), and a hit costs no compile.
if not any(importlib.util.find_spec(name) for name in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxft-tests-xla-cache-")
        atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    """Files with a `slow` test first (each file's tests kept together and in order): `make test`'s workers take a
    file at a time, so a long file started last would leave one worker running it alone."""
    first_slow = {}
    for i, item in enumerate(items):
        first_slow.setdefault(item.path, [i, False])[1] |= "slow" in item.keywords
    items.sort(key=lambda item: (not first_slow[item.path][1], first_slow[item.path][0]))
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu_check.sh runs these on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """The heap left by collection (torch, transformers, peft, jax and every test module: millions of objects that
    live until the process ends) goes to Python's permanent generation, where full collections no longer walk it
    (0.3-0.8 s each before), and young collections run about half as often: tracing makes garbage fast. The GC's
    CPU time on two of the family files: 3.4 s -> 1.6 s."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def pytest_runtest_logreport(report):
    """With JAXFT_FAILURE_LOG set (scripts/gpu_check.sh sets it), each failure's traceback is appended to that
    file the moment the test ends: pytest-xdist prints failures only in its final summary, which a timeout of the
    whole call never reaches. With JAXFT_DURATIONS_LOG set, every phase of a test that took 0.5 s or more is
    appended there as it ends (seconds, phase, outcome, worker, test), for the same reason: gpu_check.sh prints
    the slowest from it even when a call timed out. Written by the controller only (workers forward their reports
    to it)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    durations = os.environ.get("JAXFT_DURATIONS_LOG")
    if durations and report.duration >= 0.5:
        worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", "main")
        with open(durations, "a") as f:
            f.write(f"{report.duration:8.2f}  {report.when:<8} {report.outcome:<7} {worker:<4} {report.nodeid}\n")
    path = os.environ.get("JAXFT_FAILURE_LOG")
    if not path or not report.failed:
        return
    with open(path, "a") as f:
        f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
