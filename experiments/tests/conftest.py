"""The lab's tests (run by name, never by `make test`): CPU by default, `gpu`-marked tests only where a GPU is
present, as in tests/conftest.py."""

import os

import pytest

os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")  # the comparisons with fp32 torch

import jax  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if any(d.platform == "gpu" for d in jax.devices()):
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (experiments/gpu_probes.sh's device runs these)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
