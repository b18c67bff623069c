"""Public entry point: y = w * normalise(x) over the last axis (fp32 statistics), see reference.py."""

from __future__ import annotations

import jax

from .reference import rmsnorm_reference
from .xla import rmsnorm_xla

IMPLEMENTATIONS = ("xla", "reference")


def rmsnorm(x: jax.Array, weight: jax.Array, eps: float, *, implementation: str = "xla") -> jax.Array:
    """RMSNorm of `x [..., D]` with `weight [D]`. "xla": custom VJP saving only x and the inverse RMS;
    "reference": plain autodiff of the definition."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"kernels_pallas/rmsnorm/api.py: weight shape {weight.shape} must equal the last axis "
                         f"of x {x.shape[-1:]}")
    if implementation == "xla":
        return rmsnorm_xla(x, weight, float(eps))
    if implementation == "reference":
        return rmsnorm_reference(x, weight, float(eps))
    raise ValueError(f"kernels_pallas/rmsnorm/api.py: implementation={implementation!r}; choose one of "
                     f"{IMPLEMENTATIONS}")
