"""Static checks on traced programs: how large do intermediates get?

Used by the tests (and useful to callers) to prove that a loss never
materialises a ``[N, V]`` array: every equation of a jaxpr is visited,
including the bodies of ``scan``/``while``/``cond``/``pjit``/``custom_vjp``
and other higher-order primitives, whose sub-jaxprs live in the equation
parameters (as ``Jaxpr`` or ``ClosedJaxpr``, possibly inside tuples).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from jax.extend import core


def _sub_jaxprs(value: Any) -> Iterator[core.Jaxpr]:
    if isinstance(value, core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def iter_eqns(jaxpr: core.Jaxpr | core.ClosedJaxpr) -> Iterator[core.JaxprEqn]:
    """All equations of ``jaxpr`` and, recursively, of its sub-jaxprs."""
    if isinstance(jaxpr, core.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from iter_eqns(sub)


def _num_elements(var: Any) -> int:
    shape = getattr(var.aval, "shape", None)
    return 0 if shape is None else math.prod(shape)


def max_intermediate_elements(jaxpr: core.Jaxpr | core.ClosedJaxpr) -> int:
    """Largest element count of any value produced by any equation.

    Program inputs are not counted (they exist regardless); outputs of
    equations at every nesting level are.  Note that a ``scan`` body is
    counted per iteration, while the scan's stacked outputs appear at the
    outer level with their full size.
    """
    return max((_num_elements(v) for e in iter_eqns(jaxpr) for v in e.outvars), default=0)


def find_eqns(
    jaxpr: core.Jaxpr | core.ClosedJaxpr,
    primitive: str,
    out_shape: tuple[int, ...] | None = None,
) -> list[core.JaxprEqn]:
    """Equations of ``primitive`` (by name), optionally producing ``out_shape``."""
    found = []
    for eqn in iter_eqns(jaxpr):
        if eqn.primitive.name != primitive:
            continue
        if out_shape is None or any(
            tuple(getattr(v.aval, "shape", ())) == tuple(out_shape) for v in eqn.outvars
        ):
            found.append(eqn)
    return found


def transposed_copies(hlo_text: str, shape: tuple[int, int]) -> list[str]:
    """The instructions of a compiled program's text (``compiled.as_text()``) that transpose into a 2-D array of
    ``shape`` or its transpose: what a loss given ``table.T`` materialises when XLA cannot fold the transpose into
    its dots (the tied head before ``weight_layout="vh"``)."""
    a, b = shape
    names = (f"[{a},{b}]", f"[{b},{a}]")
    return [line.strip() for line in hlo_text.splitlines()
            if " transpose(" in line and any(name in line.split(" transpose(")[0] for name in names)]
