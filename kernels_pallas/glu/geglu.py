"""GeGLU (tanh-approximated gelu, Gemma's MLP) with a hand-written VJP that keeps only `gate` and `up`.

    h = gelu_tanh(g).astype(dtype) * u,   gelu_tanh(g) = 0.5 g (1 + t),  t = tanh(c (g + k g^3)),
    c = sqrt(2 / pi), k = 0.044715, evaluated in fp32 (torch's `gelu(x, approximate="tanh")`).

Autodiff of the reference saves the fp32 gate, tanh(.) and the rounded activation: several [tokens, I]
tensors per layer, the largest activations of a Gemma decoder (I = 14336 at 9B). The backward here
recomputes t from `gate`:

    gelu_tanh'(g) = 0.5 (1 + t) + 0.5 g (1 - t^2) c (1 + 3 k g^2)
    dg = dh * u * gelu_tanh'(g)
    du = dh * gelu_tanh(g).astype(dtype)
(the rounding of gelu_tanh(g) to the input dtype is treated as the identity in dg, as for SwiGLU).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_F32 = jnp.float32
_C = math.sqrt(2.0 / math.pi)
_K = 0.044715


def geglu_tanh_reference(gate: jax.Array, up: jax.Array) -> jax.Array:
    """The definition (plain autodiff): gelu_tanh in fp32, rounded to the input dtype, times up."""
    return jax.nn.gelu(gate.astype(_F32), approximate=True).astype(gate.dtype) * up


@jax.custom_vjp
def geglu_tanh_xla(gate: jax.Array, up: jax.Array) -> jax.Array:
    return geglu_tanh_reference(gate, up)


def _fwd(gate, up):
    return geglu_tanh_xla(gate, up), (gate, up)


def _bwd(residuals, dh):
    gate, up = residuals
    g = gate.astype(_F32)
    t = jnp.tanh(_C * (g + _K * g * g * g))
    act = 0.5 * g * (1.0 + t)
    dact = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _C * (1.0 + 3.0 * _K * g * g)
    dh32 = dh.astype(_F32)
    dg = dh32 * up.astype(_F32) * dact
    du = dh32 * act.astype(gate.dtype).astype(_F32)
    return dg.astype(gate.dtype), du.astype(up.dtype)


geglu_tanh_xla.defvjp(_fwd, _bwd)
