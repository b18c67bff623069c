"""Grouped matmul on Hopper with Mosaic GPU (``plgpu.kernel``): wgmma from TMA-fed shared memory, a multi-stage
pipeline over the contraction, and one ``jax.custom_vjp`` for the MoE training step.

Math (reference.py has the definition). lhs [M, K] rows sorted by group, rhs [G, K, N], sizes [G]:

    out[m]   = lhs[m] @ rhs[g(m)]             (0 for rows past sum(sizes))
    d lhs[m] = dout[m] @ rhs[g(m)]^T          the forward kernel again, reading rhs[g] as [N, K] (its
                                              transpose through the wgmma operand, never materialised)
    d rhs[g] = lhs_g^T @ dout_g               a grouped *contraction* over the rows of group g, [K, N] per
                                              group (0 for an empty group): its own kernel, not dense

Derivation: out = sum_g P_g lhs rhs[g], with P_g the 0/1 diagonal selecting group g's rows. For a scalar
loss with cotangent dout, d lhs = sum_g P_g dout rhs[g]^T (each row back through its own group's matrix,
rows past the end get no group and so 0), and d rhs[g] = (P_g lhs)^T dout = lhs_g^T dout_g. group_sizes is
integer data: no cotangent.

An expert adapter fused into the forward (``grouped_matmul_mosaic(lora=(xa, b))``): out[m] = lhs[m] @ rhs[g(m)] +
xa[m] @ b[g(m)], with xa [M, r] the rows' product with the adapter's A and b [G, r, N] its scaled B. The row kernels
start the TMA loads of the unit's xa rows and b columns (rank zero-padded to 64) before the main pipeline and, after
it, add their product to the accumulator as one more contraction step (``_lora_step``): the adapter's [M, N]
product is never written to memory and added back, and the sum is rounded once. Gradients: those of the two grouped
products (d xa = dout @ b^T per group, d b[g] = xa_g^T dout_g), by the same kernels. ``fused_config`` fits the
adapter's tiles into shared memory beside the ring (a shallower ring or 64-deep steps) or returns None, and the
adapter's product is then a second kernel. On the GPU, ``forward`` takes the fused kernel only once it has run
there (``FUSED_LORA_ON_GPU``). An adapter whose A side reads the product's own rows (``grouped_matmul_mosaic(adapter=
(a, b))``, the experts' down projection): out = gmm(lhs, rhs) + gmm(gmm(lhs, a), b) as one custom VJP
(``_gmm_adapted``), whose d lhs kernel adds d xa @ a^T the same way (the transposed row kernel with a^T as its
adapter factor; ``FUSED_DLHS_LORA_ON_GPU``).

The kernels are in `mosaic_kernels` (row tiles for the forward and d lhs, the warp-specialised variant) and
`mosaic_drhs` (d rhs), their tiles in `tiles`. bf16/f16 operands, fp32 accumulation, output in the input dtype. On
CPU the same kernels run in Mosaic GPU's interpreter (``interpret=True``: the tests; float32 operands are
accepted there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas._dispatch import target_platform
from .mosaic_drhs import gmm_drhs
from .mosaic_kernels import gmm_rows, gmm_rows_ws
from .tiles import TileConfig, _dlhs_config, config_for, fused_config

_WHERE = "kernels_pallas/grouped_matmul/mosaic.py"


def _rows(cfg: TileConfig):
    return gmm_rows_ws if cfg.warp_specialized else gmm_rows


# The fused adapter's kernels (forward, and d lhs with an adapter: `backward_lhs(adapter=)`) against the two-kernel
# form: GPT-OSS-20B's lean step 244.0 -> 240.5 ms. The flags stay so an A/B against the two-kernel form is one edit.
FUSED_LORA_ON_GPU = True
FUSED_DLHS_LORA_ON_GPU = True


def _fitted(cfg: TileConfig, contraction: int, lora, allowed: bool) -> TileConfig | None:
    """`cfg` fitted for the adapter `lora` (`fused_config`), or None when the adapter's product must be its own
    kernel (its tiles do not fit, or the fused kernel is not `allowed` here)."""
    return fused_config(cfg, contraction, lora[0].shape[1]) if allowed else None


def forward(lhs, rhs, group_sizes, key: tuple[int, int, int], *, interpret: bool = False,
            rhs_base=None, lora=None) -> jax.Array:
    """The custom VJP's forward kernel on the tiles the table gives `key` = (K, N, groups): the operands' own
    shape in training; the GPU tests pass a full bench shape's key for operands of fewer groups and rows.
    `rhs_base`, `lora`: see `gmm_rows`. With `lora`, the tiles are `fused_config`'s; where none fits, the
    adapter's product is a second kernel whose output is added (two roundings instead of one)."""
    cfg = config_for(*key)
    if lora is not None:
        fused = _fitted(cfg, key[0], lora, interpret or FUSED_LORA_ON_GPU)
        if fused is None:
            return unfused_forward(lhs, rhs, group_sizes, cfg, lora, interpret=interpret, rhs_base=rhs_base)
        cfg = fused
    return _rows(cfg)(lhs, rhs, group_sizes, cfg, interpret=interpret, rhs_base=rhs_base, lora=lora)


def unfused_forward(lhs, rhs, group_sizes, cfg: TileConfig, lora, *, interpret: bool = False, rhs_base=None):
    """gmm(lhs, rhs) on `cfg`'s tiles plus the adapter's gmm(xa, b) as a second kernel (its table entry), added
    after: what `forward` runs where the adapter's tiles do not fit, or on the GPU before FUSED_LORA_ON_GPU."""
    xa, b = lora
    out = _rows(cfg)(lhs, rhs, group_sizes, cfg, interpret=interpret, rhs_base=rhs_base)
    return out + forward(xa, b, group_sizes, _key(xa, b), interpret=interpret)


def backward_lhs(rhs, group_sizes, dout, key: tuple[int, int, int], *, interpret: bool = False, rhs_base=None,
                 adapter=None):
    """d lhs of `forward` for `key`'s tiles: dout @ rhs^T per group, a row-tile product with the table's
    (N, K, groups) entry. With `adapter` = (d xa [M, r], a [G, K, r]) plus d xa @ a^T per group: the d lhs of
    gmm(lhs, rhs) + gmm(gmm(lhs, a), b) given d xa. Fused, a^T is the kernel's adapter factor (`forward`'s `lora`,
    added in the accumulator); otherwise (tiles that do not fit, or the GPU before FUSED_DLHS_LORA_ON_GPU) d xa @ a^T
    is a's own d lhs kernel, added after."""
    cfg_dlhs = _dlhs_config(config_for(*key), *key)
    fused = None if adapter is None else _fitted(cfg_dlhs, key[1], adapter, interpret or FUSED_DLHS_LORA_ON_GPU)
    if adapter is not None and fused is None:
        return unfused_backward_lhs(rhs, group_sizes, dout, key, adapter, interpret=interpret, rhs_base=rhs_base)
    lora = None if adapter is None else (adapter[0], jnp.swapaxes(adapter[1], 1, 2))
    cfg_dlhs = cfg_dlhs if fused is None else fused
    return _rows(cfg_dlhs)(dout, rhs, group_sizes, cfg_dlhs, transpose_rhs=True, interpret=interpret,
                           rhs_base=rhs_base, lora=lora)


def unfused_backward_lhs(rhs, group_sizes, dout, key: tuple[int, int, int], adapter, *, interpret: bool = False,
                         rhs_base=None):
    """`backward_lhs` with `adapter` = (d xa, a) as two kernels: dout @ rhs^T, plus a's own d lhs d xa @ a^T added
    after (what it runs where the fused tiles do not fit, or on the GPU before FUSED_DLHS_LORA_ON_GPU)."""
    dxa, a = adapter
    return (backward_lhs(rhs, group_sizes, dout, key, interpret=interpret, rhs_base=rhs_base) +
            backward_lhs(a, group_sizes, dxa, (a.shape[1], a.shape[2], a.shape[0]), interpret=interpret))


def _drhs_at_row(lhs, dout, group_sizes, rhs, row, key: tuple[int, int, int], interpret: bool):
    """d rhs of a product with row `row` of the stack rhs [L, G, K, N]: the layer's [G, K, N] gradient placed at its
    row of a zero stack (what a frozen stack's caller never asks for: it is then dead code and compiled away)."""
    drhs_row = gmm_drhs(lhs, dout, group_sizes, config_for(*key), interpret=interpret)
    return jax.lax.dynamic_update_index_in_dim(jnp.zeros_like(rhs), drhs_row.astype(rhs.dtype), row, 0)


def backward(lhs, rhs, group_sizes, dout, key: tuple[int, int, int], *, interpret: bool = False):
    """(d lhs, d rhs) of `forward` for `key`'s tiles: d lhs by `backward_lhs`, d rhs = lhs^T @ dout per group."""
    dout = dout.astype(lhs.dtype)
    dlhs = backward_lhs(rhs, group_sizes, dout, key, interpret=interpret)
    return dlhs, gmm_drhs(lhs, dout, group_sizes, config_for(*key), interpret=interpret)


def _key(lhs, rhs) -> tuple[int, int, int]:
    return lhs.shape[1], rhs.shape[-1], rhs.shape[-3]


def _lora_grads(lora: tuple, group_sizes, dout, interpret: bool) -> tuple:
    """(d xa, d b) of a fused adapter's product xa[m] @ b[g(m)]: the grouped rules of any product (d xa by the
    row kernel against b^T, d b by the group-tile kernel); () without an adapter."""
    if not lora:
        return ()
    xa, b = lora
    return backward(xa, b, group_sizes, dout, _key(xa, b), interpret=interpret)


# `lora` is () or (xa, b): out = gmm(lhs, rhs) + gmm(xa, b), the second product fused into the first kernel's
# accumulator (one rounding, no [M, N] tensor of the adapter's product written and read back).
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gmm(lhs, rhs, group_sizes, lora: tuple, interpret: bool):
    return forward(lhs, rhs, group_sizes, _key(lhs, rhs), interpret=interpret, lora=lora or None)


def _gmm_fwd(lhs, rhs, group_sizes, lora, interpret):
    return _gmm(lhs, rhs, group_sizes, lora, interpret), (lhs, rhs, group_sizes, lora)


def _gmm_bwd(interpret, residuals, dout):
    lhs, rhs, group_sizes, lora = residuals
    return (*backward(lhs, rhs, group_sizes, dout, _key(lhs, rhs), interpret=interpret), None,
            _lora_grads(lora, group_sizes, dout, interpret))


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


# gmm(lhs, rhs[row], sizes) for a layer stack rhs [L, G, K, N] read in place. Why: in a layer scan each layer's
# expert matrices are a slice of the stack, and a slice handed to a custom call is first copied out whole (XLA
# fuses a dynamic slice only into its own GEMMs): 1.48 GiB a layer for GPT-OSS-20B, in the forward and again in the
# backward. Here the kernels index the flattened stack [L * G, K, N] (a free reshape) from row * G instead.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _gmm_row(lhs, rhs, row, group_sizes, lora: tuple, interpret: bool):
    return forward(lhs, _flat_groups(rhs), group_sizes, _key(lhs, rhs), interpret=interpret,
                   rhs_base=row * rhs.shape[1], lora=lora or None)


def _flat_groups(rhs):
    return rhs.reshape(-1, *rhs.shape[2:])


def _gmm_row_fwd(lhs, rhs, row, group_sizes, lora, interpret):
    return _gmm_row(lhs, rhs, row, group_sizes, lora, interpret), (lhs, rhs, row, group_sizes, lora)


def _gmm_row_bwd(interpret, residuals, dout):
    """d lhs from the stack in place; d rhs at the layer's row of a zero stack (`_drhs_at_row`)."""
    lhs, rhs, row, group_sizes, lora = residuals
    key = _key(lhs, rhs)
    dout = dout.astype(lhs.dtype)
    dlhs = backward_lhs(_flat_groups(rhs), group_sizes, dout, key, interpret=interpret,
                        rhs_base=row * rhs.shape[1])
    drhs = _drhs_at_row(lhs, dout, group_sizes, rhs, row, key, interpret)
    return dlhs, drhs, None, None, _lora_grads(lora, group_sizes, dout, interpret)


_gmm_row.defvjp(_gmm_row_fwd, _gmm_row_bwd)


# gmm(lhs, rhs[row]) + gmm(gmm(lhs, a), b): an expert adapter whose A side reads the product's own rows (the down
# projection's: its rows h exist only in expert order). Forward: xa = gmm(lhs, a) by the row kernel, then the
# experts' kernel with (xa, b) fused. Backward, the product rule over both paths into lhs:
#     d xa = dout @ b^T,  d lhs = dout @ rhs^T + d xa @ a^T  (one kernel: d xa @ a^T fused as its adapter),
#     d b = xa^T dout,    d a = lhs^T d xa,                   d rhs = lhs^T dout (dead code for frozen experts),
# all per group. Why one op: as two (the A product, then the fused experts' matmul) the d lhs of each is its own
# [M, K] kernel output, added after: 3 more [M, K] reads and writes a layer.
@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _gmm_adapted(lhs, rhs, row, group_sizes, a, b, interpret: bool):
    return _gmm_adapted_fwd(lhs, rhs, row, group_sizes, a, b, interpret)[0]


def _gmm_adapted_fwd(lhs, rhs, row, group_sizes, a, b, interpret):
    xa = forward(lhs, a, group_sizes, _key(lhs, a), interpret=interpret)
    out = forward(lhs, _flat_groups(rhs), group_sizes, _key(lhs, rhs), interpret=interpret,
                  rhs_base=row * rhs.shape[1], lora=(xa, b))
    return out, (lhs, rhs, row, group_sizes, a, b, xa)


def _gmm_adapted_bwd(interpret, residuals, dout):
    lhs, rhs, row, group_sizes, a, b, xa = residuals
    key = _key(lhs, rhs)
    dout = dout.astype(lhs.dtype)
    dxa = backward_lhs(b, group_sizes, dout, _key(xa, b), interpret=interpret)
    dlhs = backward_lhs(_flat_groups(rhs), group_sizes, dout, key, interpret=interpret, rhs_base=row * rhs.shape[1],
                        adapter=(dxa, a))
    db = gmm_drhs(xa, dout, group_sizes, config_for(*_key(xa, b)), interpret=interpret)
    da = gmm_drhs(lhs, dxa, group_sizes, config_for(*_key(lhs, a)), interpret=interpret)
    drhs = _drhs_at_row(lhs, dout, group_sizes, rhs, row, key, interpret)
    return dlhs, drhs, None, None, da.astype(a.dtype), db.astype(b.dtype)


_gmm_adapted.defvjp(_gmm_adapted_fwd, _gmm_adapted_bwd)


def grouped_matmul_mosaic(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, row=None, lora=None,
                          adapter=None, interpret: bool | None = None) -> jax.Array:
    """out = gmm(lhs, rhs, group_sizes) by the Mosaic GPU kernels, differentiable in lhs and rhs; with `row` (int
    scalar) rhs is a stack [L, G, K, N] and out = gmm(lhs, rhs[row], group_sizes), the stack read in place; with
    `lora` = (xa [M, r], b [G, r, N]) the adapter's gmm(xa, b) is added in the kernel's accumulator (differentiable
    in xa and b too); with `adapter` = (a [G, K, r], b [G, r, N]) plus gmm(gmm(lhs, a), b) (`_gmm_adapted`).
    ``interpret`` defaults to True off-GPU (Mosaic GPU's CPU interpreter)."""
    if interpret is None:
        interpret = target_platform() != "gpu"
    if not interpret and jnp.dtype(lhs.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"{_WHERE}: the Mosaic GPU grouped matmul takes bfloat16/float16 operands, got "
                         f"{lhs.dtype}; cast them, or use implementation='xla'")
    if adapter is not None:  # a lone [G, K, N] is a stack of one, read at row 0
        stack, at = (rhs[None], 0) if row is None else (rhs, row)
        return _gmm_adapted(lhs, stack, jnp.asarray(at, jnp.int32), group_sizes.astype(jnp.int32), *adapter,
                            bool(interpret))
    lora = () if lora is None else tuple(lora)
    if row is None:
        return _gmm(lhs, rhs, group_sizes.astype(jnp.int32), lora, bool(interpret))
    return _gmm_row(lhs, rhs, jnp.asarray(row, jnp.int32), group_sizes.astype(jnp.int32), lora, bool(interpret))
