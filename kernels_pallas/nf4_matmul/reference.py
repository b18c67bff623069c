"""The definition of the 4-bit matmul: dequantise bitsandbytes' blockwise 4-bit weight, then multiply.

A frozen weight W [out, in] (torch's layout, row-major) is stored as

    packed [ceil(out*in / 2)] uint8    element k sits in byte k // 2: the HIGH nibble for even k, the LOW for odd
    absmax [ceil(out*in / blocksize)] float32    one scale per run of `blocksize` consecutive elements

and W.flat[k] = code[nibble(k)] * absmax[k // blocksize] (`codes.code_4bit`), computed in float32 and rounded
once to the compute dtype. The op is y = x W^T for x [..., in]. It is linear in x, so dy/dx needs only W:
dx = dy W, and W itself gets no gradient (it is frozen and integer-coded).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .codes import code_4bit


def unpack_nibbles(packed: jax.Array, n: int) -> jax.Array:
    """The first `n` 4-bit values of `packed` (uint8 [ceil(n/2)]) as int32, first value of a byte = high nibble."""
    packed = packed.reshape(-1).astype(jnp.int32)
    pairs = jnp.stack([packed >> 4, packed & 0xF], axis=-1)  # [bytes, 2]: (high, low)
    return pairs.reshape(-1)[:n]


def dequantize_4bit(packed: jax.Array, absmax: jax.Array, *, shape: tuple[int, int], blocksize: int,
                    quant_type: str = "nf4", dtype=jnp.bfloat16) -> jax.Array:
    """W [*shape] in `dtype` from its packed codes and float32 block absmax (see the module docstring)."""
    n = math.prod(shape)
    code = jnp.asarray(code_4bit(quant_type))
    values = code[unpack_nibbles(packed, n)]  # float32 [n]
    blocks = -(-n // blocksize)
    values = jnp.pad(values, (0, blocks * blocksize - n)).reshape(blocks, blocksize)
    scaled = values * absmax.reshape(blocks, 1).astype(jnp.float32)
    return scaled.reshape(-1)[:n].reshape(shape).astype(dtype)


def nf4_matmul_reference(x: jax.Array, packed: jax.Array, absmax: jax.Array, *, shape: tuple[int, int],
                         blocksize: int, quant_type: str = "nf4") -> jax.Array:
    """y = x W^T, W = dequantize_4bit(...) in x's dtype; plain autodiff (saves the dequantised W)."""
    w = dequantize_4bit(packed, absmax, shape=shape, blocksize=blocksize, quant_type=quant_type, dtype=x.dtype)
    return jnp.einsum("...i,oi->...o", x, w)
