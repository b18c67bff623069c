"""The FP8-stored matmul dequantised to the compute dtype, with a custom VJP that re-dequantises in the backward:
what runs where the device has no FP8 tensor cores (CPU, GPUs before Ada/Hopper). The only residuals are the
FP8 codes and scales, which exist anyway (autodiff would keep the dequantised [out, in] weight alive from each
layer's forward to its backward, twice the FP8 bytes):

    y  = x W^T,   W = dequantize_fp8(q, scale) in x's dtype
    dx = dy W     (y is linear in x: x itself is not needed)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import dequantize_fp8


@jax.custom_vjp
def _matmul(x, q, scale):
    with jax.named_scope("fp8_matmul_dequant"):
        return jnp.einsum("...i,oi->...o", x, dequantize_fp8(q, scale, x.dtype))


def _fwd(x, q, scale):
    return _matmul(x, q, scale), (q, scale)


def _bwd(residuals, dy):
    q, scale = residuals
    with jax.named_scope("fp8_matmul_dequant_dx"):
        return jnp.einsum("...o,oi->...i", dy, dequantize_fp8(q, scale, dy.dtype)), None, None


_matmul.defvjp(_fwd, _bwd)


def fp8_matmul_dequant(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """y = x W^T with the re-dequantising VJP (see the module docstring)."""
    return _matmul(x, q, scale)
