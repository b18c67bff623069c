"""Public entry point: y = x W^T for a bitsandbytes 4-bit weight W (see reference.py), and the op's registry
``OP`` (names as in kernels_pallas/_dispatch.py: "xla" the re-dequantising custom VJP, "reference"). "xla"
dequantises the whole weight, then runs one cuBLAS matmul: 2.5-4.7x faster on the 8B projections at 8k-16k tokens
than dequantising tiles inside the matmul's K loop."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kernels_pallas._dispatch import reference_and_xla

from .codes import QUANT_TYPES
from .reference import nf4_matmul_reference
from .xla import nf4_matmul_xla

_WHERE = "kernels_pallas/nf4_matmul/api.py"

OP = reference_and_xla("nf4_matmul", _WHERE, nf4_matmul_reference, nf4_matmul_xla,
                       "dequantise-then-matmul, custom VJP re-dequantising in the backward")
IMPLEMENTATIONS = OP.accepted


def nf4_matmul(x: jax.Array, packed: jax.Array, absmax: jax.Array, *, shape: tuple[int, int], blocksize: int,
               quant_type: str = "nf4", implementation: str | None = "xla") -> jax.Array:
    """x [..., in] times the 4-bit weight [out, in] = `shape` transposed -> [..., out] in x's dtype.

    `packed`: uint8 [ceil(out*in/2)]; `absmax`: float32 [ceil(out*in/blocksize)] (already de-nested)."""
    impl = OP.resolve(implementation)
    out_features, in_features = shape
    n = out_features * in_features
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"{_WHERE}: quant_type={quant_type!r}; use one of {QUANT_TYPES}")
    if x.shape[-1] != in_features:
        raise ValueError(f"{_WHERE}: x {x.shape} does not end in in_features={in_features} of shape {shape}")
    if packed.dtype != jnp.uint8 or packed.size != -(-n // 2):
        raise ValueError(f"{_WHERE}: packed must be uint8 with {-(-n // 2)} bytes for shape {shape}, "
                         f"got {packed.dtype} {packed.shape}")
    if absmax.size != math.ceil(n / blocksize):
        raise ValueError(f"{_WHERE}: absmax has {absmax.size} values; shape {shape} in blocks of {blocksize} "
                         f"needs {math.ceil(n / blocksize)}")
    return impl.fn(x, packed, absmax, shape=tuple(shape), blocksize=blocksize, quant_type=quant_type)
