"""The 4-bit matmul in XLA with a custom VJP that re-dequantises in the backward pass.

Forward: W = dequantize(packed, absmax) in x's dtype, y = x W^T. Autodiff would keep that W ([out, in] in the
compute dtype, 4x the packed bytes) alive from the forward to the backward of every layer; here the only
residuals are the packed codes and the absmax, which exist anyway, and the backward rebuilds W:

    dx = dy W            (y is linear in x: x itself is not needed)
    d packed = d absmax = nothing (frozen, integer-coded)

so at most one layer's dequantised weight exists at a time, forward or backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .reference import dequantize_4bit


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _matmul(x, packed, absmax, shape, blocksize, quant_type):
    w = dequantize_4bit(packed, absmax, shape=shape, blocksize=blocksize, quant_type=quant_type, dtype=x.dtype)
    return jnp.einsum("...i,oi->...o", x, w)


def _fwd(x, packed, absmax, shape, blocksize, quant_type):
    return _matmul(x, packed, absmax, shape, blocksize, quant_type), (packed, absmax)


def _bwd(shape, blocksize, quant_type, residuals, dy):
    packed, absmax = residuals
    w = dequantize_4bit(packed, absmax, shape=shape, blocksize=blocksize, quant_type=quant_type, dtype=dy.dtype)
    dx = jnp.einsum("...o,oi->...i", dy, w)
    return dx, None, None


_matmul.defvjp(_fwd, _bwd)


def nf4_matmul_xla(x: jax.Array, packed: jax.Array, absmax: jax.Array, *, shape: tuple[int, int],
                   blocksize: int, quant_type: str = "nf4") -> jax.Array:
    """y = x W^T with the re-dequantising VJP (see the module docstring)."""
    return _matmul(x, packed, absmax, tuple(int(d) for d in shape), int(blocksize), quant_type)
