"""Public entry point: h = silu(gate) * up (the gated MLP's activation), see reference.py."""

from __future__ import annotations

import jax

from .reference import swiglu_reference
from .xla import swiglu_xla

IMPLEMENTATIONS = ("xla", "reference")


def swiglu(gate: jax.Array, up: jax.Array, *, implementation: str = "xla") -> jax.Array:
    """silu(gate) * up. "xla": custom VJP saving only gate and up; "reference": plain autodiff."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"kernels_pallas/glu/api.py: gate {gate.shape} {gate.dtype} and up {up.shape} {up.dtype} "
                         "must have the same shape and dtype")
    if implementation == "xla":
        return swiglu_xla(gate, up)
    if implementation == "reference":
        return swiglu_reference(gate, up)
    raise ValueError(f"kernels_pallas/glu/api.py: implementation={implementation!r}; choose one of {IMPLEMENTATIONS}")
