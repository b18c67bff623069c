"""SwiGLU with a hand-written VJP that keeps only `gate` and `up`.

Autodiff of silu(g) * u saves sigmoid(g), silu(g) and the product's operands: for an MLP of width I that
is several [tokens, I] tensors per layer, the largest activations of a decoder. Here the backward
recomputes sigmoid in fp32 from `gate`.

    s   = sigmoid(g),  silu(g) = g s,  silu'(g) = s (1 + g (1 - s))
    dg  = dh * u * silu'(g)
    du  = dh * silu(g)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32


@jax.custom_vjp
def swiglu_xla(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate.astype(_F32)).astype(gate.dtype) * up


def _fwd(gate, up):
    return swiglu_xla(gate, up), (gate, up)


def _bwd(residuals, dh):
    gate, up = residuals
    g = gate.astype(_F32)
    s = jax.nn.sigmoid(g)
    dh32 = dh.astype(_F32)
    dg = dh32 * up.astype(_F32) * s * (1.0 + g * (1.0 - s))
    du = dh32 * (g * s).astype(gate.dtype).astype(_F32)
    return dg.astype(gate.dtype), du.astype(up.dtype)


swiglu_xla.defvjp(_fwd, _bwd)
