"""GPT-OSS's clamped SwiGLU of an interleaved gate/up product, with a hand-written VJP that keeps only the product.

For x [..., 2I] (even columns gate, odd columns up), limit L and alpha (transformers' GptOssExperts):

    g = min(x[..., 0::2], L),   u = clip(x[..., 1::2], -L, L),   s = sigmoid(alpha g)
    h = (u + 1) * (g * s)                                   (in x's dtype, as transformers computes it)

Autodiff of that saves the two strided halves, both clamps' comparisons, sigmoid(.), g * s and u + 1: several
[rows, I] tensors per MoE layer (GPT-OSS-20B: k = 4 rows a token at I = 2880; with no remat, the largest
activations of its layer scan). The backward here recomputes them from x, in fp32, rounded once:

    dh/dg = (u + 1) (s + alpha g s (1 - s))    where x_g < L, else 0
    dh/du = g s                                where -L < x_u < L, else 0
    dx[..., 0::2] = dh dh/dg,   dx[..., 1::2] = dh dh/du

The clamps pass the gradient strictly inside their bounds and none on them, as torch's clamp does (the oracle:
transformers' GptOssExperts; checked against the torch installed here, tests/test_norm_glu_ops.py). Autodiff of
`jnp.minimum` / `jnp.clip` gives half at an input equal to a bound, which in bf16 happens (7.0 is a bf16 value).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_F32 = jnp.float32


def clamped_swiglu_reference(gate_up: jax.Array, limit: float, alpha: float) -> jax.Array:
    """The definition (plain autodiff; see the module docstring for its gradient at the bounds)."""
    gate = jnp.minimum(gate_up[..., 0::2], limit)
    up = jnp.clip(gate_up[..., 1::2], -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def clamped_swiglu_xla(gate_up: jax.Array, limit: float, alpha: float) -> jax.Array:
    return clamped_swiglu_reference(gate_up, limit, alpha)


def _fwd(gate_up, limit, alpha):
    return clamped_swiglu_reference(gate_up, limit, alpha), gate_up


def _bwd(limit, alpha, gate_up, dh):
    xg, xu = gate_up[..., 0::2].astype(_F32), gate_up[..., 1::2].astype(_F32)
    g, u = jnp.minimum(xg, limit), jnp.clip(xu, -limit, limit)
    s = jax.nn.sigmoid(alpha * g)
    d = dh.astype(_F32)
    dg = jnp.where(xg < limit, d * (u + 1) * (s + alpha * g * s * (1 - s)), 0.0)
    du = jnp.where((xu > -limit) & (xu < limit), d * g * s, 0.0)
    return (jnp.stack([dg, du], axis=-1).reshape(gate_up.shape).astype(gate_up.dtype),)


clamped_swiglu_xla.defvjp(_fwd, _bwd)
