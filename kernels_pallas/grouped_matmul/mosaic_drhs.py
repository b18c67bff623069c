"""The Mosaic GPU d rhs kernel of the grouped matmul: d rhs[g] = lhs_g^T @ dout_g for lhs [M, K], dout [M, N] (rows
sorted by group), [G, K, N], 0 for an empty group. A grouped *contraction*: each output tile of group g sums over
that group's rows. (The math and the custom VJP: `mosaic`; the row kernels: `mosaic_kernels`; tiles: `tiles`.)

Every SM loops over (group, K-block, N-block) units; each unit runs its own pipeline over the ``dw_block_t``-row
blocks its group's rows touch, zeroes (in shared memory, before the wgmma) the rows of its first and last block that
belong to a neighbouring group, and stores its tile. An empty group runs no step and stores 0. Every unit fills its
pipeline from empty and drains it (at Qwen3-30B-A3B's ~512 rows a group, 8 contraction steps a unit), so the table
runs two blocks to an SM where their shared memory fits (``TileConfig.dw_blocks_per_sm``): one block's fill, drain and
store under the other's products: Qwen3-30B-A3B's down d rhs runs at 452.5 TFLOP/s against 375.5 for one block.

No host sync: group_sizes stays on the device, the schedule is computed there in plain jnp. lhs and dout are
zero-padded to the tiles here and the result sliced back. bf16/f16 operands, fp32 accumulation, output in the
input dtype; on CPU the kernel runs in Mosaic GPU's interpreter (``interpret=True``, float32 accepted).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .mosaic_kernels import _kernel, _pad, _swizzled
from .tiles import TileConfig

_WHERE = "kernels_pallas/grouped_matmul/mosaic_drhs.py"


def gmm_drhs(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, cfg: TileConfig, *,
             interpret: bool = False) -> jax.Array:
    """d rhs[g] = lhs_g^T @ dout_g for lhs [M, K], dout [M, N]: [G, K, N], 0 for empty groups (the module's
    docstring)."""
    m, k = lhs.shape
    n = dout.shape[1]
    lhs_p = _pad(_pad(lhs, 0, cfg.block_m), 1, cfg.dw_block_k)
    dout_p = _pad(_pad(dout, 0, cfg.block_m), 1, cfg.dw_block_n)
    return _drhs_group_tiles(lhs_p, dout_p, group_sizes, cfg, interpret)[:, :k, :n]


def _mask_rows(a_smem, row0, start, end, block_t: int, block_k: int):
    """Zero the rows of the [block_t, block_k] lhs block `a_smem` (rows row0 .. row0 + block_t of lhs) outside
    [start, end), in shared memory, before a wgmma reads it."""
    rows = plgpu.layout_cast(jax.lax.broadcasted_iota(jnp.int32, (block_t, block_k), 0), plgpu.Layout.WGMMA) + row0
    keep = ((rows >= start) & (rows < end)).astype(a_smem.dtype)
    a_smem[...] = a_smem[...] * keep
    plgpu.commit_smem()


def _group_blocks(group_sizes: jax.Array, block_t: int):
    """(starts, ends, first block, blocks) int32 [G] of the groups' rows on the grid of `block_t`-row blocks: a
    group's rows are [starts, ends) and touch blocks first .. first + blocks - 1 (0 blocks for an empty group)."""
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // block_t
    return starts, ends, first, jnp.where(sizes > 0, (ends - 1) // block_t - first + 1, 0)


def _drhs_group_tiles(lhs_p, dout_p, group_sizes, cfg: TileConfig, interpret: bool) -> jax.Array:
    """The group-tile schedule on operands padded to the tiles: [G, Kp, Np]."""
    g = group_sizes.shape[0]
    bt, bk, bn = cfg.dw_block_t, cfg.dw_block_k, cfg.dw_block_n
    kp, np_ = lhs_p.shape[1], dout_p.shape[1]
    starts, ends, first, n_blocks = _group_blocks(group_sizes, bt)
    grid_k, grid_n = kp // bk, np_ // bn
    dtype = lhs_p.dtype
    a_transforms, b_transforms = _swizzled(bk, dtype), _swizzled(bn, dtype)

    def body(starts_ref, ends_ref, first_ref, nb_ref, lhs_ref, dout_ref, out_ref):
        @plgpu.nd_loop((g, grid_k * grid_n), collective_axes="sm")
        def _(info: plgpu.NDLoopInfo):
            gi = info.index[0]
            ki, ni = plgpu.planar_snake(info.index[1], (grid_k, grid_n), 1, 1)  # d rhs: not swept
            start, end, first_block, nb = starts_ref[gi], ends_ref[gi], first_ref[gi], nb_ref[gi]

            def acc_scope(acc_ref):
                def step(idx, a_smem, b_smem):
                    row0 = (first_block + idx[0]) * bt

                    @pl.when((row0 < start) | (row0 + bt > end))
                    def _():  # an edge block holds rows of the neighbouring groups
                        _mask_rows(a_smem, row0, start, end, bt, bk)

                    plgpu.wgmma(acc_ref, a_smem.transpose((1, 0)), b_smem)

                @pl.when(nb > 0)
                def _():
                    plgpu.emit_pipeline(
                        step, grid=(nb,), max_concurrent_steps=cfg.dw_stages,
                        in_specs=[
                            plgpu.BlockSpec((bt, bk), lambda t: (first_block + t, ki), delay_release=1,
                                            transforms=a_transforms),
                            plgpu.BlockSpec((bt, bn), lambda t: (first_block + t, ni), delay_release=1,
                                            transforms=b_transforms),
                        ],
                    )(lhs_ref, dout_ref)

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bk, bn)))

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bk, bn), dtype=dtype, transforms=b_transforms))
            def _(o_smem):
                o_smem[...] = acc.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, out_ref.at[gi, pl.ds(ki * bk, bk), pl.ds(ni * bn, bn)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return _kernel(body, jax.ShapeDtypeStruct((g, kp, np_), dtype), interpret, "gmm_drhs", cfg.dw_blocks_per_sm)(
        starts, ends, first, n_blocks, lhs_p, dout_p)
