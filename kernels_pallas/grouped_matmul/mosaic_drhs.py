"""The Mosaic GPU d rhs kernels of the grouped matmul: d rhs[g] = lhs_g^T @ dout_g for lhs [M, K], dout [M, N] (rows
sorted by group), [G, K, N], 0 for an empty group. A grouped *contraction*: each output tile of group g sums over
that group's rows. (The math and the custom VJP: `mosaic`; the row kernels: `mosaic_kernels`; tiles: `tiles`.)

Two schedules, chosen by ``TileConfig.dw_chunks``:

- 0, group tiles (``_drhs_group_tiles``): every SM loops over (group, K-block, N-block) units; each unit runs its own
  pipeline over the ``dw_block_t``-row blocks its group's rows touch, zeroes (in shared memory, before the wgmma) the
  rows of its first and last block that belong to a neighbouring group, and stores its tile. An empty group runs no
  step and stores 0. Every unit fills its pipeline from empty and drains it: at Qwen3-30B-A3B's ~512 rows a group,
  8 contraction steps a unit.
- C > 0, streamed (``_drhs_streamed``): the groups are cut into C chunks of consecutive groups (about equal numbers
  of steps, `drhs_schedule`) and every SM loops over (chunk, K-block, N-block) units. One pipeline walks the unit's
  whole chunk as a list of segments, a segment being one row block of one group (a block that two groups share is
  two segments, each loaded and masked to its group's rows); after a group's last segment its accumulator is
  stored to the group's tile and the next group opens a fresh one, while the ring goes on loading. So a pipeline
  fills once per chunk instead of once per group, and the tile stores overlap the loads. An empty group is one
  segment with no row kept (its tile stores 0). Measured on an H100 it was slower than the group tiles on both
  Qwen3-30B-A3B shapes (down 343 against 393 TFLOP/s in 4 chunks, gate_up 400 against 459; docs/benchmarks.md
  section 43), so no table entry streams; the sweep times it (`bench._dw_variants`). In that version each step read
  its rows from global memory before its wgmma; a step now reads the next step's while its own product runs (not
  yet measured).

No host sync: group_sizes stays on the device, the schedules are computed there in plain jnp. lhs and dout are
zero-padded to the tiles here and the result sliced back. bf16/f16 operands, fp32 accumulation, output in the
input dtype; on CPU the kernels run in Mosaic GPU's interpreter (``interpret=True``, float32 accepted).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .mosaic_kernels import _kernel, _pad, _swizzled
from .tiles import _SMEM_BYTES, TileConfig, drhs_smem_bytes

_WHERE = "kernels_pallas/grouped_matmul/mosaic_drhs.py"


def gmm_drhs(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, cfg: TileConfig, *,
             interpret: bool = False) -> jax.Array:
    """d rhs[g] = lhs_g^T @ dout_g for lhs [M, K], dout [M, N]: [G, K, N], 0 for empty groups; the schedule of
    ``cfg.dw_chunks`` (the module's docstring)."""
    m, k = lhs.shape
    n = dout.shape[1]
    if cfg.dw_chunks and not interpret and drhs_smem_bytes(cfg, lhs.dtype.itemsize) > _SMEM_BYTES:
        raise ValueError(f"{_WHERE}: the streamed d rhs on {cfg.dw_block_k} x {cfg.dw_block_n} tiles in "
                         f"{cfg.dw_stages} stages needs {drhs_smem_bytes(cfg, lhs.dtype.itemsize)} bytes of shared "
                         f"memory, over {_SMEM_BYTES}; take the config from tiles.streamed_drhs_config")
    lhs_p = _pad(_pad(lhs, 0, cfg.block_m), 1, cfg.dw_block_k)
    dout_p = _pad(_pad(dout, 0, cfg.block_m), 1, cfg.dw_block_n)
    kernel = _drhs_streamed if cfg.dw_chunks else _drhs_group_tiles
    return kernel(lhs_p, dout_p, group_sizes, cfg, interpret)[:, :k, :n]


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


_LO_BITS = 8  # a segment's word (`drhs_schedule`): the first kept row, then the end of the kept rows


def num_segments(m: int, g: int, block_t: int) -> int:
    """A static bound on `drhs_schedule`'s segments: a group spans at most one block more than its share of the
    m / block_t blocks (the one it shares with its neighbour), and an empty group is one segment."""
    return m // block_t + 2 * g


def drhs_schedule(group_sizes: jax.Array, m: int, block_t: int, chunks: int):
    """The streamed d rhs schedule, on the device, int32: (blocks [S], words [S], seg_start [G], seg_count [G],
    group_bounds [chunks + 1]), S = `num_segments`.

    Segment i is row block blocks[i], keeping rows [lo, hi) of the block (lo = words[i] & 255, hi = words[i] >> 8);
    group g's segments are seg_start[g] .. seg_start[g] + seg_count[g] - 1, its blocks in order, groups in order
    (an empty group: one segment keeping no row). Chunk c is groups group_bounds[c] .. group_bounds[c + 1] - 1: from
    the first group whose first segment is at or past c / chunks of all the segments, so a chunk holds whole groups
    and about an equal share of the steps (a chunk may hold none). Segments past the last group's are slack. m is a
    multiple of block_t."""
    g = group_sizes.shape[0]
    if block_t >= 1 << _LO_BITS:
        raise ValueError(f"{_WHERE}: the streamed d rhs packs rows < {1 << _LO_BITS} a block, got "
                         f"dw_block_t={block_t}")
    starts, ends, first, blocks = _group_blocks(group_sizes, block_t)
    count = jnp.maximum(blocks, 1)  # an empty group: one segment
    seg_end = jnp.cumsum(count)
    seg_start = seg_end - count
    i = jnp.arange(num_segments(m, g, block_t), dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(seg_end, i, side="right"), g - 1).astype(jnp.int32)
    block = first[group] + i - seg_start[group]
    row0 = block * block_t
    lo = jnp.clip(starts[group] - row0, 0, block_t)
    hi = jnp.maximum(jnp.clip(ends[group] - row0, 0, block_t), lo)
    # (an empty group at the very end starts at m: its kept-nothing segment loads the last block instead)
    block = jnp.clip(block, 0, m // block_t - 1)
    targets = jnp.arange(chunks + 1, dtype=jnp.int32) * seg_end[-1] // chunks
    group_bounds = jnp.searchsorted(seg_start, targets, side="left").astype(jnp.int32)
    group_bounds = group_bounds.at[-1].set(g)
    return block, lo | (hi << _LO_BITS), seg_start, count, group_bounds


def _drhs_streamed(lhs_p, dout_p, group_sizes, cfg: TileConfig, interpret: bool) -> jax.Array:
    """The streamed schedule on operands padded to the tiles: [G, Kp, Np]. Its pipeline is written out (a ring of
    dw_stages slots, one barrier each) rather than `plgpu.emit_pipeline`'s: each group's accumulator is its own
    scope inside the walk over the chunk's segments, which a pipeline body cannot open (and Mosaic GPU's interpreter
    cannot store to an accumulator to zero it). Step j of a unit waits for its slot, multiplies, leaves its wgmma
    running while the previous step's finishes (``wgmma_wait(1)``), and refills that step's slot with step
    j - 1 + stages, whichever group that step belongs to."""
    g = group_sizes.shape[0]
    bt, bk, bn, chunks, stages = cfg.dw_block_t, cfg.dw_block_k, cfg.dw_block_n, cfg.dw_chunks, cfg.dw_stages
    mp, kp, np_ = lhs_p.shape[0], lhs_p.shape[1], dout_p.shape[1]
    schedule = drhs_schedule(group_sizes, mp, bt, chunks)
    grid_k, grid_n = kp // bk, np_ // bn
    dtype = lhs_p.dtype
    a_transforms, b_transforms = _swizzled(bk, dtype), _swizzled(bn, dtype)
    low = (1 << _LO_BITS) - 1

    def body(blocks_ref, words_ref, seg_start_ref, seg_count_ref, bounds_ref, lhs_ref, dout_ref, out_ref,
             a_ring, b_ring, loaded, o_smem):
        def unit(c, ki, ni):
            g0, g1 = bounds_ref[c], bounds_ref[c + 1]
            first = seg_start_ref[g0]  # the unit's steps: its chunk's segments, first .. first + count - 1
            count = seg_start_ref[g1 - 1] + seg_count_ref[g1 - 1] - first

            def fetch(j):
                slot = j % stages
                rows = pl.ds(pl.multiple_of(blocks_ref[first + j] * bt, bt), bt)
                plgpu.copy_gmem_to_smem(lhs_ref.at[rows, pl.ds(ki * bk, bk)], a_ring.at[slot], loaded.at[slot])
                plgpu.copy_gmem_to_smem(dout_ref.at[rows, pl.ds(ni * bn, bn)], b_ring.at[slot], loaded.at[slot])

            for j in range(stages):
                pl.when(j < count)(functools.partial(fetch, j))

            last = words_ref.shape[0] - 1

            def group(gi, word):
                def acc_scope(acc_ref):
                    def step(j, word):  # `word`: this step's, read during the step before
                        slot = j % stages
                        plgpu.barrier_wait(loaded.at[slot])
                        lo, hi = word & low, word >> _LO_BITS

                        @pl.when((lo > 0) | (hi < bt))
                        def _():  # a block shared with a neighbouring group, or an empty group's segment
                            _mask_rows(a_ring.at[slot], 0, lo, hi, bt, bk)

                        plgpu.wgmma(acc_ref, a_ring.at[slot].transpose((1, 0)), b_ring.at[slot])
                        # The next step's word, read while this product runs: not on the path to the next wgmma.
                        following = words_ref[jnp.minimum(first + j + 1, last)]
                        plgpu.wgmma_wait(1)  # step j - 1's product is done: its slot may take step j - 1 + stages

                        @pl.when((j >= 1) & (j - 1 + stages < count))
                        def _():
                            fetch(j - 1 + stages)

                        return following

                    s0 = seg_start_ref[gi] - first
                    following = jax.lax.fori_loop(s0, s0 + seg_count_ref[gi], step, word)
                    return acc_ref[...], following  # (waits for the group's last product)

                acc, following = pl.run_scoped(acc_scope, plgpu.ACC((bk, bn)))
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous group's store left o_smem
                o_smem[...] = acc.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, out_ref.at[gi, pl.ds(ki * bk, bk), pl.ds(ni * bn, bn)])
                return following

            jax.lax.fori_loop(g0, g1, group, words_ref[first])

        # Units chunk-major: the SMs working at once share a chunk's row blocks in L2.
        @plgpu.nd_loop((chunks * grid_k * grid_n,), collective_axes="sm")
        def _(info: plgpu.NDLoopInfo):
            c = info.index[0] // (grid_k * grid_n)
            ki, ni = plgpu.planar_snake(info.index[0] % (grid_k * grid_n), (grid_k, grid_n), 1, 1)
            pl.when(bounds_ref[c + 1] > bounds_ref[c])(lambda: unit(c, ki, ni))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scratch = (plgpu.SMEM((stages, bt, bk), dtype, transforms=a_transforms),
               plgpu.SMEM((stages, bt, bn), dtype, transforms=b_transforms),
               plgpu.Barrier(num_arrivals=2, num_barriers=stages),
               plgpu.SMEM((bk, bn), dtype, transforms=b_transforms))
    return _kernel(body, jax.ShapeDtypeStruct((g, kp, np_), dtype), interpret, "gmm_drhs_streamed",
                   scratch_types=scratch)(*schedule, lhs_p, dout_p)
