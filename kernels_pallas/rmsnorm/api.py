"""Public entry points: y = w * normalise(x) over the last axis (fp32 statistics) and Gemma's
y = (1 + w) * normalise(x) in fp32, see reference.py; and their registries ``OP`` / ``OFFSET_OP`` (names as in
kernels_pallas/_dispatch.py: "xla" custom VJP, "reference")."""

from __future__ import annotations

import jax

from kernels_pallas._dispatch import reference_and_xla

from .reference import rmsnorm_offset_reference, rmsnorm_reference
from .xla import rmsnorm_offset_xla, rmsnorm_xla

_WHERE = "kernels_pallas/rmsnorm/api.py"

OP = reference_and_xla("rmsnorm", _WHERE, rmsnorm_reference, rmsnorm_xla, "custom VJP saving x and the inverse RMS")
IMPLEMENTATIONS = OP.accepted

OFFSET_OP = reference_and_xla("rmsnorm_offset", _WHERE, rmsnorm_offset_reference, rmsnorm_offset_xla,
                              "custom VJP saving x and the inverse RMS")


def rmsnorm(x: jax.Array, weight: jax.Array, eps: float, *, implementation: str | None = "xla",
            offset: bool = False) -> jax.Array:
    """RMSNorm of `x [..., D]` with `weight [D]`; `offset=True` scales by (1 + weight) in fp32 (Gemma).
    "xla": custom VJP saving only x and the inverse RMS; "reference": plain autodiff of the definition;
    "auto"/None: "xla"."""
    impl = (OFFSET_OP if offset else OP).resolve(implementation)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"{_WHERE}: weight shape {weight.shape} must equal the last axis "
                         f"of x {x.shape[-1:]}")
    return impl.fn(x, weight, float(eps))
