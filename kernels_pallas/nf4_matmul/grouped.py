"""The grouped (MoE expert) matmul on 4-bit weights: out[m] = lhs[m] @ W_g(m), each group's weight stored in
bitsandbytes' blockwise 4-bit format as ITS OWN [out, in] matrix (torch's layout, as bitsandbytes would quantise
each expert's weight), i.e. W_g = dequantize(packed[g], absmax[g])^T [in, out].

    reference: W = dequantize every group in lhs's dtype, then `grouped_matmul(lhs, W, sizes)`; plain autodiff,
               which keeps the dequantised [G, in, out] weight from the forward to the backward.
    xla:       the same forward under a custom VJP whose only residuals are the 4-bit bytes and the absmax
               (which exist anyway) and the group sizes. Since out is linear in lhs and the weights are frozen,

                   d lhs[m] = d out[m] @ W_g(m)^T = grouped_matmul(d out, dequantize(...) [G, out, in], sizes)

               (the dequantised [out, in] matrices are exactly the W^T the backward needs: no transpose), and
               packed / absmax / sizes get no cotangent. So at most one layer's dequantised experts exist at a
               time, forward or backward; a layer scan saves 4-bit bytes, not bf16 weights, for its backward.

The grouped matmul itself is `kernels_pallas.grouped_matmul`, forward and backward alike, with the
implementation `gmm_implementation` names (the MoE blocks pass `ExecutionConfig.grouped_matmul_implementation`;
default "auto"). It is a static (non-differentiable) argument of the custom VJP, so the backward's grouped matmul
is the forward's choice.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kernels_pallas._dispatch import AUTO, reference_and_xla
from kernels_pallas.grouped_matmul import OP as GMM_OP
from kernels_pallas.grouped_matmul import grouped_matmul

from .codes import QUANT_TYPES
from .reference import dequantize_4bit

_WHERE = "kernels_pallas/nf4_matmul/grouped.py"


def dequantize_groups(packed: jax.Array, absmax: jax.Array, *, shape: tuple[int, int], blocksize: int,
                      quant_type: str, dtype) -> jax.Array:
    """[G, out, in] in `dtype`: `dequantize_4bit` of each group's bytes [G, ceil(out*in/2)] and float32 absmax
    [G, blocks]."""
    return jax.vmap(lambda p, a: dequantize_4bit(p, a, shape=shape, blocksize=blocksize, quant_type=quant_type,
                                                 dtype=dtype))(packed, absmax)


def nf4_grouped_matmul_reference(lhs, packed, absmax, group_sizes, *, shape, blocksize, quant_type="nf4",
                                 gmm_implementation=AUTO):
    """Dequantise then `grouped_matmul`, differentiated by autodiff (saves the dequantised weights)."""
    w = dequantize_groups(packed, absmax, shape=shape, blocksize=blocksize, quant_type=quant_type, dtype=lhs.dtype)
    return grouped_matmul(lhs, jnp.swapaxes(w, 1, 2), group_sizes, implementation=gmm_implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _gmm(lhs, packed, absmax, group_sizes, shape, blocksize, quant_type, gmm_implementation):
    return nf4_grouped_matmul_reference(lhs, packed, absmax, group_sizes, shape=shape, blocksize=blocksize,
                                        quant_type=quant_type, gmm_implementation=gmm_implementation)


def _fwd(lhs, packed, absmax, group_sizes, shape, blocksize, quant_type, gmm_implementation):
    out = _gmm(lhs, packed, absmax, group_sizes, shape, blocksize, quant_type, gmm_implementation)
    return out, (packed, absmax, group_sizes)


def _bwd(shape, blocksize, quant_type, gmm_implementation, residuals, dout):
    packed, absmax, group_sizes = residuals
    wt = dequantize_groups(packed, absmax, shape=shape, blocksize=blocksize, quant_type=quant_type, dtype=dout.dtype)
    return grouped_matmul(dout, wt, group_sizes, implementation=gmm_implementation), None, None, None


_gmm.defvjp(_fwd, _bwd)


def nf4_grouped_matmul_xla(lhs, packed, absmax, group_sizes, *, shape, blocksize, quant_type="nf4",
                           gmm_implementation=AUTO):
    """The re-dequantising custom VJP (see the module docstring)."""
    return _gmm(lhs, packed, absmax, group_sizes, tuple(int(d) for d in shape), int(blocksize), quant_type,
                gmm_implementation)


OP = reference_and_xla("nf4_grouped_matmul", _WHERE, nf4_grouped_matmul_reference, nf4_grouped_matmul_xla,
                       "dequantise-then-grouped-matmul, custom VJP re-dequantising in the backward")


def nf4_grouped_matmul(lhs: jax.Array, packed: jax.Array, absmax: jax.Array, group_sizes: jax.Array, *,
                       shape: tuple[int, int], blocksize: int, quant_type: str = "nf4",
                       implementation: str | None = "xla", gmm_implementation: str | None = AUTO) -> jax.Array:
    """lhs [M, in] sorted by group times each group's 4-bit weight (`shape` = (out, in), torch's layout) ->
    [M, out] in lhs's dtype. `packed` uint8 [G, ceil(out*in/2)], `absmax` float32 [G, ceil(out*in/blocksize)]
    (already de-nested), `group_sizes` [G] int. `implementation` is this op's ("reference" / "xla"),
    `gmm_implementation` that of the grouped matmul inside it (forward and backward)."""
    impl = OP.resolve(implementation)
    gmm_implementation = GMM_OP.canonical(gmm_implementation)  # a bad name fails here, before any tracing
    out_features, in_features = shape
    n = out_features * in_features
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"{_WHERE}: quant_type={quant_type!r}; use one of {QUANT_TYPES}")
    if lhs.ndim != 2 or lhs.shape[-1] != in_features:
        raise ValueError(f"{_WHERE}: lhs must be [M, {in_features}] for shape {shape}, got {lhs.shape}")
    if packed.dtype != jnp.uint8 or packed.ndim != 2 or packed.shape[1] != -(-n // 2):
        raise ValueError(f"{_WHERE}: packed must be uint8 [G, {-(-n // 2)}] for shape {shape}, "
                         f"got {packed.dtype} {packed.shape}")
    if absmax.shape != (packed.shape[0], math.ceil(n / blocksize)):
        raise ValueError(f"{_WHERE}: absmax must be [{packed.shape[0]}, {math.ceil(n / blocksize)}] (shape {shape} in "
                         f"blocks of {blocksize}), got {absmax.shape}")
    return impl.fn(lhs, packed, absmax, group_sizes, shape=tuple(shape), blocksize=blocksize, quant_type=quant_type,
                   gmm_implementation=gmm_implementation)
