"""The grouped (MoE expert) matmul on FP8 weights: out[m] = lhs[m] @ W_g(m), each group's weight stored as
float8_e4m3fn codes q[g] [out, in] (torch's layout) with a float32 scale grid scale[g] [out / bm, in / bn], one
factor per bm x bn block:

    W_g^T[o, i] = q[g, o, i] * scale[g, o // bm, i // bn]     (the product in float32, rounded once to lhs's dtype)

One grid covers both layouts the experts come in: a scale per output channel (bm = 1, bn = in: a grid [out, 1],
`quantize_rows` of each expert), and the blocks of transformers' fine-grained FP8 checkpoints (128 x 128, their
`weight_scale_inv`, multiplied exactly as transformers' `Fp8Dequantize` does).

    reference: dequantise every group in lhs's dtype, then `grouped_matmul(lhs, W, sizes)`; plain autodiff, which
               keeps the dequantised [G, in, out] weight from the forward to the backward.
    xla:       the same forward under a custom VJP whose only residuals are the codes and scales (which exist
               anyway) and the group sizes. Out is linear in lhs and the weights are frozen, so

                   d lhs = grouped_matmul(d out, dequantize(q, scale) [G, out, in], sizes)

               (the stored [out, in] layout is the W^T the backward needs), and q / scale / sizes get no
               cotangent. At most one layer's dequantised experts exist at a time, forward or backward; a layer
               scan saves FP8 bytes, not bf16 weights, for its backward.

The grouped matmul itself is `kernels_pallas.grouped_matmul` with the implementation `gmm_implementation` names
(forward and backward alike), as in `kernels_pallas.nf4_matmul.grouped`. Block scales do not factor out of a
contraction over `in`, so the products run in the compute dtype, not on FP8 tensor cores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas._dispatch import AUTO, reference_and_xla
from kernels_pallas.grouped_matmul import OP as GMM_OP
from kernels_pallas.grouped_matmul import grouped_matmul

from .reference import E4M3

_WHERE = "kernels_pallas/fp8_matmul/grouped.py"


def dequantize_blocks(q: jax.Array, scale: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """W [..., out, in] in `dtype` from codes q [..., out, in] and a scale grid [..., out / bm, in / bn]: each
    code times its block's scale in float32, rounded once."""
    *lead, rows, cols = q.shape
    grid_rows, grid_cols = scale.shape[-2:]
    if rows % grid_rows or cols % grid_cols:
        raise ValueError(f"{_WHERE}: codes [{rows}, {cols}] are not a whole number of blocks of the scale grid "
                         f"[{grid_rows}, {grid_cols}]")
    bm, bn = rows // grid_rows, cols // grid_cols
    w = q.astype(jnp.float32).reshape(*lead, grid_rows, bm, grid_cols, bn)
    w = w * scale.astype(jnp.float32)[..., :, None, :, None]
    return w.reshape(*lead, rows, cols).astype(dtype)


def fp8_grouped_matmul_reference(lhs, q, scale, group_sizes, *, gmm_implementation=AUTO):
    """Dequantise then `grouped_matmul`, differentiated by autodiff (saves the dequantised weights)."""
    w = dequantize_blocks(q, scale, lhs.dtype)
    return grouped_matmul(lhs, jnp.swapaxes(w, 1, 2), group_sizes, implementation=gmm_implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gmm(lhs, q, scale, group_sizes, gmm_implementation):
    with jax.named_scope("fp8_grouped_matmul_dequant"):
        return fp8_grouped_matmul_reference(lhs, q, scale, group_sizes, gmm_implementation=gmm_implementation)


def _fwd(lhs, q, scale, group_sizes, gmm_implementation):
    return _gmm(lhs, q, scale, group_sizes, gmm_implementation), (q, scale, group_sizes)


def _bwd(gmm_implementation, residuals, dout):
    q, scale, group_sizes = residuals
    with jax.named_scope("fp8_grouped_matmul_dequant_dx"):
        wt = dequantize_blocks(q, scale, dout.dtype)
        return grouped_matmul(dout, wt, group_sizes, implementation=gmm_implementation), None, None, None


_gmm.defvjp(_fwd, _bwd)


def fp8_grouped_matmul_xla(lhs, q, scale, group_sizes, *, gmm_implementation=AUTO):
    """The re-dequantising custom VJP (see the module docstring)."""
    return _gmm(lhs, q, scale, group_sizes, gmm_implementation)


OP = reference_and_xla("fp8_grouped_matmul", _WHERE, fp8_grouped_matmul_reference, fp8_grouped_matmul_xla,
                       "dequantise-then-grouped-matmul, custom VJP re-dequantising in the backward")


def fp8_grouped_matmul(lhs: jax.Array, q: jax.Array, scale: jax.Array, group_sizes: jax.Array, *,
                       implementation: str | None = "xla", gmm_implementation: str | None = AUTO) -> jax.Array:
    """lhs [M, in] sorted by group times each group's FP8 weight -> [M, out] in lhs's dtype. `q` float8_e4m3fn
    [G, out, in] (torch's layout), `scale` float32 [G, out / bm, in / bn], `group_sizes` [G] int.
    `implementation` is this op's ("reference" / "xla"), `gmm_implementation` that of the grouped matmul inside it
    (forward and backward)."""
    impl = OP.resolve(implementation)
    gmm_implementation = GMM_OP.canonical(gmm_implementation)  # a bad name fails here, before any tracing
    if q.ndim != 3 or q.dtype != jnp.dtype(E4M3):
        raise ValueError(f"{_WHERE}: q must be float8_e4m3fn [G, out, in], got {q.dtype} {q.shape}")
    if scale.ndim != 3 or scale.shape[0] != q.shape[0] or q.shape[1] % scale.shape[1] or q.shape[2] % scale.shape[2]:
        raise ValueError(f"{_WHERE}: scale must be [G, out / bm, in / bn] for q {q.shape}, got {scale.shape}")
    if lhs.ndim != 2 or lhs.shape[1] != q.shape[2]:
        raise ValueError(f"{_WHERE}: lhs must be [M, {q.shape[2]}] for q {q.shape}, got {lhs.shape}")
    return impl.fn(lhs, q, scale, group_sizes, gmm_implementation=gmm_implementation)
