"""RMSNorm with a hand-written VJP that keeps only x (in its own dtype) and r = rsqrt(mean(x^2)+eps).

Plain autodiff of the reference saves the fp32 copy of x and the fp32 normalised activations: for a bf16
model that is 2-3x the bytes of x per norm, per layer. Here the backward recomputes n = x32 * r.

Gradient (d = last-axis size, n = x32 * r, g = dy * w in fp32; the cast of n to x.dtype is treated as
the identity, as in every fused RMSNorm):
    dn  = g
    dx  = r * (dn - n * mean(dn * n))            since dn_i/dx_j = r (delta_ij - n_i n_j / d)
    dw  = sum over all leading axes of dy * n.astype(x.dtype)
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

_F32 = jnp.float32


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def rmsnorm_xla(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    return _forward(x, weight, eps)[0]


def _inv_rms(x, eps):
    """(x in fp32, r = rsqrt(mean(x32^2) + eps) per row)."""
    x32 = x.astype(_F32)
    return x32, jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def _forward(x, weight, eps):
    x32, r = _inv_rms(x, eps)
    return weight.astype(x.dtype) * (x32 * r).astype(x.dtype), r


def _fwd(x, weight, eps):
    y, r = _forward(x, weight, eps)
    return y, (x, weight, r)


def _dx(x, r, g):
    """(dx in fp32, n = x32 * r) for the normalisation's input given g = dL/dn (formula in the docstring)."""
    n = x.astype(_F32) * r
    return r * (g - n * jnp.mean(g * n, axis=-1, keepdims=True)), n


def _bwd(eps, residuals, dy):
    del eps
    x, weight, r = residuals
    dx, n = _dx(x, r, dy.astype(_F32) * weight.astype(_F32))
    dw = jnp.sum((dy.astype(_F32) * n.astype(x.dtype).astype(_F32)).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), dw.astype(weight.dtype)


rmsnorm_xla.defvjp(_fwd, _bwd)


# Gemma's form, y = (n * (1 + w)) in fp32 then rounded (n = x32 * r). With s = 1 + w32 the gradient is the
# one above with g = dy * s, and dw = sum of dy * n in fp32 (no rounding of n: the product is fp32 here).
@partial(jax.custom_vjp, nondiff_argnums=(2,))
def rmsnorm_offset_xla(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    return _offset_forward(x, weight, eps)[0]


def _offset_forward(x, weight, eps):
    x32, r = _inv_rms(x, eps)
    return (x32 * r * (1.0 + weight.astype(_F32))).astype(x.dtype), r


def _offset_fwd(x, weight, eps):
    y, r = _offset_forward(x, weight, eps)
    return y, (x, weight, r)


def _offset_bwd(eps, residuals, dy):
    del eps
    x, weight, r = residuals
    dy32 = dy.astype(_F32)
    dx, n = _dx(x, r, dy32 * (1.0 + weight.astype(_F32)))
    dw = jnp.sum((dy32 * n).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), dw.astype(weight.dtype)


rmsnorm_offset_xla.defvjp(_offset_fwd, _offset_bwd)
