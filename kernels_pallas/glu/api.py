"""Public entry point: h = silu(gate) * up (the gated MLP's activation), see reference.py; and the op's
registry ``OP`` (names as in kernels_pallas/_dispatch.py: "xla" custom VJP, "reference")."""

from __future__ import annotations

import jax

from kernels_pallas._dispatch import ALL_PLATFORMS, Implementation, Op

from .reference import swiglu_reference
from .xla import swiglu_xla

_WHERE = "kernels_pallas/glu/api.py"

OP = Op(
    name="swiglu",
    where=_WHERE,
    implementations=(
        Implementation("reference", swiglu_reference, ALL_PLATFORMS, summary="autodiff of the definition"),
        Implementation("xla", swiglu_xla, ALL_PLATFORMS, summary="custom VJP saving gate and up only"),
    ),
    auto_order=("xla", "reference"),
)
IMPLEMENTATIONS = OP.accepted


def swiglu(gate: jax.Array, up: jax.Array, *, implementation: str | None = "xla") -> jax.Array:
    """silu(gate) * up. "xla": custom VJP saving only gate and up; "reference": plain autodiff;
    "auto"/None: "xla"."""
    impl = OP.resolve(implementation)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"{_WHERE}: gate {gate.shape} {gate.dtype} and up {up.shape} {up.dtype} "
                         "must have the same shape and dtype")
    return impl.fn(gate, up)
