"""Public entry points: h = silu(gate) * up (SwiGLU, see reference.py) and h = gelu_tanh(gate) * up (GeGLU,
see geglu.py), the gated MLP's activation, and GPT-OSS's clamped SwiGLU of an interleaved gate/up product
(clamped.py); and their registries ``OP`` / ``GEGLU_OP`` / ``CLAMPED_OP`` (names as in kernels_pallas/_dispatch.py:
"xla" custom VJP, "reference")."""

from __future__ import annotations

import jax

from kernels_pallas._dispatch import reference_and_xla

from .clamped import clamped_swiglu_reference, clamped_swiglu_xla
from .geglu import geglu_tanh_reference, geglu_tanh_xla
from .reference import swiglu_reference
from .xla import swiglu_xla

_WHERE = "kernels_pallas/glu/api.py"

OP = reference_and_xla("swiglu", _WHERE, swiglu_reference, swiglu_xla, "custom VJP saving gate and up only")
IMPLEMENTATIONS = OP.accepted

GEGLU_OP = reference_and_xla("geglu_tanh", _WHERE, geglu_tanh_reference, geglu_tanh_xla,
                             "custom VJP saving gate and up only")
CLAMPED_OP = reference_and_xla("clamped_swiglu", _WHERE, clamped_swiglu_reference, clamped_swiglu_xla,
                               "custom VJP saving the gate/up product only")


def _check(gate: jax.Array, up: jax.Array) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"{_WHERE}: gate {gate.shape} {gate.dtype} and up {up.shape} {up.dtype} "
                         "must have the same shape and dtype")


def swiglu(gate: jax.Array, up: jax.Array, *, implementation: str | None = "xla") -> jax.Array:
    """silu(gate) * up. "xla": custom VJP saving only gate and up; "reference": plain autodiff;
    "auto"/None: "xla"."""
    impl = OP.resolve(implementation)
    _check(gate, up)
    return impl.fn(gate, up)


def geglu_tanh(gate: jax.Array, up: jax.Array, *, implementation: str | None = "xla") -> jax.Array:
    """gelu_tanh(gate) * up (Gemma's MLP). "xla": custom VJP saving only gate and up; "reference": plain
    autodiff; "auto"/None: "xla"."""
    impl = GEGLU_OP.resolve(implementation)
    _check(gate, up)
    return impl.fn(gate, up)


def clamped_swiglu(gate_up: jax.Array, limit: float, alpha: float, *, implementation: str | None = "xla") -> jax.Array:
    """GPT-OSS's (min(g, L) * sigmoid(alpha min(g, L))) * (clip(u, -L, L) + 1) of interleaved gate/up columns
    [..., 2I] -> [..., I]. "xla": custom VJP saving only `gate_up`; "reference": plain autodiff; "auto"/None: "xla"."""
    impl = CLAMPED_OP.resolve(implementation)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"{_WHERE}: clamped_swiglu takes interleaved gate/up columns, an even count; got "
                         f"{gate_up.shape}")
    return impl.fn(gate_up, float(limit), float(alpha))
