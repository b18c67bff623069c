"""Public entry point: y = w * normalise(x) over the last axis (fp32 statistics), see reference.py; and
the op's registry ``OP`` (names as in kernels_pallas/_dispatch.py: "xla" custom VJP, "reference")."""

from __future__ import annotations

import jax

from kernels_pallas._dispatch import ALL_PLATFORMS, Implementation, Op

from .reference import rmsnorm_reference
from .xla import rmsnorm_xla

_WHERE = "kernels_pallas/rmsnorm/api.py"

OP = Op(
    name="rmsnorm",
    where=_WHERE,
    implementations=(
        Implementation("reference", rmsnorm_reference, ALL_PLATFORMS, summary="autodiff of the definition"),
        Implementation("xla", rmsnorm_xla, ALL_PLATFORMS, summary="custom VJP saving x and the inverse RMS"),
    ),
    auto_order=("xla", "reference"),
)
IMPLEMENTATIONS = OP.accepted


def rmsnorm(x: jax.Array, weight: jax.Array, eps: float, *, implementation: str | None = "xla") -> jax.Array:
    """RMSNorm of `x [..., D]` with `weight [D]`. "xla": custom VJP saving only x and the inverse RMS;
    "reference": plain autodiff of the definition; "auto"/None: "xla"."""
    impl = OP.resolve(implementation)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"{_WHERE}: weight shape {weight.shape} must equal the last axis "
                         f"of x {x.shape[-1:]}")
    return impl.fn(x, weight, float(eps))
