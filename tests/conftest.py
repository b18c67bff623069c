"""Shared test setup: CPU by default, `gpu`-marked tests only where a GPU is present."""

import os

import pytest

# Tests compare against fp32 torch: keep XLA's CPU matmuls at full precision.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import jax  # noqa: E402


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu_check.sh runs these on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With JAXFT_FAILURE_LOG set (scripts/gpu_check.sh sets it), each failure's traceback is appended to that
    file the moment the test ends: pytest-xdist prints failures only in its final summary, which a timeout of the
    whole call never reaches. Written by the controller only (workers forward their reports to it)."""
    path = os.environ.get("JAXFT_FAILURE_LOG")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a") as f:
        f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")
