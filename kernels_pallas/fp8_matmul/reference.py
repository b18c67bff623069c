"""The definition of the FP8 matmul: a frozen weight stored in float8_e4m3fn with one scale per output channel,
dequantised, then multiplied in the compute dtype.

A weight W [out, in] (torch's layout) is stored as

    q     [out, in] float8_e4m3fn   q[o, i] = fp8(clip(W[o, i] / scale[o], -448, 448))   (round to nearest even)
    scale [out]     float32         scale[o] = max_i |W[o, i]| * float32(1 / 448)          (0 for a zero row)

and W ~= q * scale[:, None] (448 is e4m3fn's largest finite value: the largest |W| of a row lands on it). The
op is y = x W^T for x [..., in]; W gets no gradient (it is frozen). `quantize_rows` is the same rounding for any
array over its last axis: the weight's rows here, the activations' and output gradients' rows in the FP8 GEMM
implementation (fp8.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0


def quantize_rows(a: jax.Array, dtype=E4M3) -> tuple[jax.Array, jax.Array]:
    """(q in `dtype`, float32 scale [...]) of `a` [..., n]: one scale per row (last axis), amax / 448 (as a
    multiplication by float32(1/448), which XLA would make of a division by the constant anyway)."""
    a32 = a.astype(jnp.float32)
    scale = jnp.max(jnp.abs(a32), axis=-1) * jnp.float32(1.0 / E4M3_MAX)
    safe = jnp.where(scale > 0, scale, 1.0)  # a zero row: codes 0, scale 0
    q = jnp.clip(a32 / safe[..., None], -E4M3_MAX, E4M3_MAX).astype(dtype)
    return q, scale


def dequantize_fp8(q: jax.Array, scale: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """W [..., out, in] in `dtype`: q * scale per row, in float32, rounded once."""
    return (q.astype(jnp.float32) * scale[..., None].astype(jnp.float32)).astype(dtype)


def fp8_matmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """y = x W^T, W = dequantize_fp8(q, scale) in x's dtype; plain autodiff (saves the dequantised W)."""
    return jnp.einsum("...i,oi->...o", x, dequantize_fp8(q, scale, x.dtype))
