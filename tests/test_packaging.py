"""pyproject.toml: setuptools reads it without a deprecation warning (what `pip install -e .` would print as a
banner), the license is an SPDX expression, and the description claims nothing that is not built."""

from __future__ import annotations

import importlib
import tomllib
import warnings
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_setuptools_reads_the_metadata_without_warnings():
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), PYPROJECT)
    assert [f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught] == []
    assert dist.metadata.license_expression == "Apache-2.0"
    assert dist.metadata.name == "jaxft"
    # The description names only what is built: QLoRA is jaxft.quant (NF4 bases), MoE the expert models.
    assert "QLoRA" in dist.metadata.description and "MoE" in dist.metadata.description
    for module in ("jaxft.quant", "jaxft.models.moe"):
        importlib.import_module(module)


def test_build_requirement_allows_the_spdx_license():
    """An SPDX `license` string needs setuptools >= 77; the build requirement says so, and the installed
    setuptools (used by `pip install --no-build-isolation -e .`) meets it."""
    import setuptools

    requires = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["build-system"]["requires"]
    assert requires == ["setuptools>=77"]
    assert int(setuptools.__version__.split(".")[0]) >= 77
