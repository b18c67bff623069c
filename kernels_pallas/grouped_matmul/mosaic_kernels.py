"""The Mosaic GPU (``plgpu.kernel``) grouped-matmul row kernels on Hopper: wgmma from TMA-fed shared memory, a
multi-stage pipeline over the contraction. The math, the gradients and the custom VJP that runs them: `mosaic`;
their tiles: `tiles`.

Forward / d-lhs kernel ("row tiles"). Each group's rows are cut into tiles of ``block_m`` rows from the group's
first row, so only a group's last tile is partial; a tile multiplies block_m rows by that group's matrix and stores
only the group's rows (a ladder of power-of-two TMA stores, since a TMA store has a static size). The schedule
(group, first row loaded, first and end row stored, per tile) is computed on the device from group_sizes in plain
jnp (``row_tiles``): at most ``num_row_tiles`` tiles, with the rows past the last group as one extra
pseudo-group whose tiles store zeros; tiles past the real count store nothing. Every SM loops over (tile, N-block)
pairs. (A tile's first loaded row is rounded down to a multiple of 8, which Mosaic GPU needs proven.)

The d rhs kernels (a grouped contraction over each group's rows) are in `mosaic_drhs`; the helpers here (the
persistent kernel, swizzles, padding) serve both modules.

No host sync: group_sizes stays on the device; one compiled program serves every split. Shapes that do not
fit the tiles (K or N not a multiple of the block, M not a multiple of block_m) are zero-padded here and
sliced back: padded rows fall into the pseudo-group (0), padded contraction columns add 0.

A layer's experts read in place (``grouped_matmul_mosaic(row=)``): rhs is then a stack [L, G, K, N], flattened
to [L * G, K, N] (a reshape, no copy), and the row-tile kernels read matrix ``row * G + group`` through a
per-tile index array made beside the schedule (``_rhs_window``). In a layer scan a slice of the stack handed to
the custom call would be copied out whole first. d rhs is then the layer's [G, K, N] gradient at its row of a
zero stack, which is dead code for frozen experts and compiled away.

Two row-tile kernels: ``gmm_rows`` (one warpgroup issues the TMA loads and the wgmmas) and ``gmm_rows_ws``
(warp-specialised: a memory warpgroup feeds two compute warpgroups that split the tile along N or M and store their
rows while the next tile loads); ``tiles.CONFIGS`` picks one per shape. The warp-specialised kernel chains the
pipelines of an SM's units (``TileConfig.chained``, JAX's ``pipeline_state``): the memory warpgroup goes on loading
the next unit while the compute warpgroups finish and store this one, instead of draining the ring after every unit.
Three variants measured on an H100 against the chained table entries of both Qwen3-30B-A3B shapes and dropped
(docs/benchmarks.md section 43; in git history): a wgmma left in flight across contraction steps (2-5% slower than
the unchained kernel it modifies, 6-17% under the chained entry), clusters of two blocks sharing each lhs tile by
TMA multicast (3-7% slower), and whole tiles stored through a swizzled staging tile (-3% to +0.6%). So neither the tensor cores draining between steps, nor L2 reads,
nor bank conflicts in the epilogue limit these shapes. Section 44 (H100) took the Qwen3-30B-A3B forward apart
(the lab's probe): its 128 ragged groups run 6-9% under equal groups of whole tiles, and those 23-27% under one group
of the same rows and units; a unit that starts on a fresh expert matrix costs ~4 us besides its products, ~1 us on
one matrix. Eight remedies measured and dropped (git history): an L2 prefetch of the SM's next unit's tiles
(`plgpu.async_prefetch`, 14-53% slower), the output staged in 64-row pieces to free a fourth stage (2-3% slower),
each SM taking runs of 4 or 8 tiles at one N-block to reuse an expert tile (37-50% slower, section 45), each
group's expert tiles asked of the L2 once, 8-32 tiles before their first use (3-48% slower, section 45; worst at
K x 4, where each ask is 1.5 MB: the prefetches seem to hold up the SM's own TMA loads, not measured directly), and
a 128-row part multiplying only the 64-row half it stores (0.4-2% faster in five sweep comparisons, 1.8% slower in
the A/B of section 45: within the spread), and a group's later tiles moved a wave or two along the walk, so that
only the first of them would wait for its experts from HBM (10-51% slower, section 47: the tiles of a group that
share its expert tiles gain from running at once), and clusters of two blocks taking two tiles of one group with
the expert tile multicast to both (1-5% slower on six of seven probe problems, section 48), and a ping-pong kernel
whose two compute warpgroups took alternate 128 x 128 or 128 x 192 units from one hand-written ring, one storing
while the other multiplied (4-10% slower on all four Qwen3 kernels, 15-19% on the dense one-group problem: unshared
lhs tiles, 1.33x the operand bytes per product, cost more than the overlapped epilogue saves; section 49).
Measured on an H200 (the four bench shapes, ragged sizes, kernels queued: docs/benchmarks.md section 35): forward
461-606 TFLOP/s, forward+backward 467-560; the 600 / 500 target is met by GPT-OSS-20B's gate_up forward only and
missed by both Qwen3-30B-A3B shapes (forward 534 and 461; the down shape's K = 768 gives a tile 12 contraction
steps) and GPT-OSS-20B's down forward (593); dense XLA matmuls of the same FLOPs: 704-770 forward. Most per-entry
numbers in ``tiles.CONFIGS`` are older sweeps timed one synced call at a time (lower by 6-78%).

bf16/f16 operands, fp32 accumulation, output in the input dtype. On CPU the same kernels run in Mosaic
GPU's interpreter (``interpret=True``: the tests; float32 operands are accepted there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .tiles import _LORA_ALIGN, TileConfig

_WHERE = "kernels_pallas/grouped_matmul/mosaic_kernels.py"
_INTERPRET_SMS = 2  # "SMs" the interpreter simulates: each one is a thread on the CPU


_HOPPER_SMS = 132  # H100 / H200 SXM: the grid when lowering for a GPU from a machine without one


def _num_sms(interpret: bool) -> int:
    if interpret:
        return _INTERPRET_SMS
    return getattr(jax.devices()[0], "core_count", None) or _HOPPER_SMS


def _kernel(body, out_type, interpret: bool, name: str, blocks_per_sm: int = 1, **threads):
    """A persistent kernel: `blocks_per_sm` blocks per SM (grid axis "sm"; the blocks of an SM run at once when
    their shared memory and registers fit, TileConfig.blocks_per_sm)."""
    return plgpu.kernel(body, out_type=out_type, grid=(_num_sms(interpret) * blocks_per_sm,), grid_names=("sm",),
                        **threads,
                        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
                        interpret=plgpu.InterpretGPUParams() if interpret else None, kernel_name=name)


def _swizzled(minor: int, dtype) -> tuple:
    """Tiling + swizzle transforms for a shared-memory tile whose minor dimension has ``minor`` elements."""
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def _pad(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


_ROW_ALIGN = 8  # a loaded block's first row: Mosaic GPU needs it a proven multiple of the smem tiling's 8 rows


def num_row_tiles(m: int, g: int, block_m: int) -> int:
    """A static bound on `row_tiles`' tile count: sum over the G + 1 groups (with the pseudo-group) of
    cdiv(n_g + 7, block_m) <= (m + (G + 1) (block_m + 6)) / block_m."""
    return (m + (g + 1) * (block_m + _ROW_ALIGN - 2)) // block_m


def row_tiles(group_sizes: jax.Array, m: int, block_m: int):
    """The row-tile schedule, on the device: (group, row0, lo, hi) int32 arrays of `num_row_tiles` tiles.

    Tiles follow their group, not the global block_m grid: tile i of a group with rows [s, e) multiplies the block_m
    rows from row0 = base + i block_m, base = s rounded down to a multiple of 8 (the alignment Mosaic GPU needs for
    the load), and stores the group's rows among them, [lo, hi) = [max(s, row0), min(e, row0 + block_m)). A tile
    past m - block_m loads from m - block_m instead (inside the array, still a multiple of 8; the rows before lo
    are multiplied and not stored). Why: on the global grid every block that a group boundary crosses is visited
    once per group, about G whole tiles of extra work (12.5% at GPT-OSS-20B's 32 groups of ~1024 rows in 128-row
    tiles); following the groups, a group's last tile is its only partial one (about G / 2 tiles). Measured on the
    H200 against the grid's tiles, the kernels' speed did not change beyond the bench's +-5% order effect
    (docs/benchmarks.md section 24).
    group == G is the pseudo-group of the rows past sum(group_sizes) (stored as 0); tiles past the real count
    have group G + 1 and lo == hi (nothing stored). m is a multiple of block_m (the kernels pad it)."""
    g = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    starts = jnp.concatenate([starts, ends[-1:]])
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    base = starts - starts % _ROW_ALIGN
    count = jnp.where(ends > starts, (ends - base + block_m - 1) // block_m, 0)
    cum = jnp.cumsum(count)
    t = jnp.arange(num_row_tiles(m, g, block_m), dtype=jnp.int32)
    group = jnp.searchsorted(cum, t, side="right").astype(jnp.int32)
    gc = jnp.minimum(group, g)
    row0 = base[gc] + (t - (cum[gc] - count[gc])) * block_m
    lo = jnp.maximum(starts[gc], row0)
    hi = jnp.minimum(ends[gc], row0 + block_m)
    valid = group <= g
    lo = jnp.where(valid, lo, 0)
    hi = jnp.where(valid, hi, 0)
    row0 = jnp.where(valid, jnp.minimum(row0, m - block_m), 0)
    return group, row0, lo, hi


def _lora_operands(lora, lhs_rows: int, block_m: int, width: int, g: int):
    """The fused adapter's operands for a row kernel whose lhs has `lhs_rows` rows and whose output `width` columns
    (padded): xa [lhs_rows, r] -> [rows padded to block_m, rp], b [G, r, N] -> [G, rp, width], zero-padded (rp = r
    rounded up to _LORA_ALIGN; zero rank columns add 0). None when there is no adapter."""
    if lora is None:
        return None
    xa, b = lora
    if xa.shape[0] != lhs_rows or b.shape[0] != g or xa.shape[1] != b.shape[1]:
        raise ValueError(f"{_WHERE}: the fused adapter needs xa [M, r] and b [G, r, N] beside lhs [M, K] and G "
                         f"groups, got xa {xa.shape}, b {b.shape}, M {lhs_rows}, G {g}")
    b = jnp.pad(b, [(0, 0), (0, -b.shape[1] % _LORA_ALIGN), (0, width - b.shape[2])])
    return _pad(_pad(xa, 0, block_m), 1, _LORA_ALIGN), b


def _real_tiles(group: jax.Array, g: int) -> jax.Array:
    """[1] int32: how many of `row_tiles`' tiles are real (a group's or the pseudo-group's); they come first."""
    return jnp.sum(group <= g, dtype=jnp.int32)[None]


def _rhs_window(rhs: jax.Array, g: int, rhs_base, pads: dict[int, int]):
    """(rhs, tile -> rhs index function) for a row-tile kernel over G = `g` groups whose matrices are
    rhs[base + group]: rhs is [G, ...] with base 0, or a longer stack ([R, ...], R a multiple of G: a layer stack
    of experts flattened by `grouped_matmul_mosaic(row=)`) read in place from `rhs_base`, so the layer's
    matrices are never copied out of the stack. Were an axis of rhs to need zero-padding to the tiles (`pads`:
    {axis: multiple}), padding the whole stack would copy it, so the G matrices are sliced out first."""
    base = jnp.zeros((), jnp.int32) if rhs_base is None else jnp.asarray(rhs_base, jnp.int32)
    if rhs.shape[0] != g and any(rhs.shape[a] % m for a, m in pads.items()):
        rhs, base = jax.lax.dynamic_slice_in_dim(rhs, base, g), jnp.zeros((), jnp.int32)
    return rhs, lambda group: base + jnp.minimum(group, g - 1)


def _row_operands(lhs, rhs, group_sizes, bm: int, bk: int, width: int, transpose_rhs: bool, rhs_base, lora):
    """What both row-tile kernels launch on: lhs and rhs zero-padded to their tiles (`width`: the output columns one
    unit computes), the matrix index of each tile (`_rhs_window`), the schedule (`row_tiles`), the fused adapter's
    operands (`_lora_operands`), the padded M and N, and the grid: N-blocks and contraction steps."""
    m, g = lhs.shape[0], group_sizes.shape[0]
    rhs, rhs_index = _rhs_window(rhs, g, rhs_base, {2: bk, 1: width} if transpose_rhs else {1: bk, 2: width})
    lhs_p = _pad(_pad(lhs, 0, bm), 1, bk)
    rhs_p = _pad(_pad(rhs, 2, bk), 1, width) if transpose_rhs else _pad(_pad(rhs, 1, bk), 2, width)
    mp, kp = lhs_p.shape
    np_ = rhs_p.shape[1] if transpose_rhs else rhs_p.shape[2]
    return (lhs_p, rhs_p, rhs_index, row_tiles(group_sizes, mp, bm), _lora_operands(lora, m, bm, np_, g), mp, np_,
            np_ // width, kp // bk)


def _unit(flat, count, grid_n: int, cfg: TileConfig):
    """(row tile, N-block) of unit `flat` of the row-tile kernels' loop: `plgpu.planar_snake` over (tile, N-block)
    with ``grid_block_n`` N-blocks side by side (nd_loop hands SM s the units s, s + S, s + 2 S, ... of S blocks)."""
    return plgpu.planar_snake(flat, (count, grid_n), 1, cfg.grid_block_n or grid_n)


def _store_rows(acc, out_ref, row0, start, size, col0, block_m: int, block_n: int):
    """Store rows [start, start + size) of the [block_m, block_n] tile ``acc`` to out[row0 + start + i, col0:]
    through a scratch tile in shared memory, and wait for the stores."""

    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_m, block_n), dtype=out_ref.dtype))
    def _(o_smem):
        o_smem[...] = acc.astype(o_smem.dtype)
        plgpu.commit_smem()
        _store_rows_from(o_smem, out_ref, row0, start, size, col0, block_m, block_n)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def gmm_rows(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, cfg: TileConfig, *,
             transpose_rhs: bool = False, interpret: bool = False, rhs_base=None, lora=None) -> jax.Array:
    """out[m] = lhs[m] @ rhs[g(m)] (rhs [G, K, N]), or with ``transpose_rhs`` lhs[m] @ rhs[g(m)]^T (rhs
    [G, N, K]); rows past sum(group_sizes) are 0. Pads to the tiles and slices back. With ``rhs_base`` (int32
    scalar) rhs may be a longer stack whose matrices rhs_base .. rhs_base + G - 1 are used (`_rhs_window`).
    With ``lora`` = (xa [M, r], b [G, r, N]) (not with transpose_rhs): out[m] = lhs[m] @ rhs[g(m)] + xa[m] @ b[g(m)],
    the adapter's product added in the accumulator (`_lora_step`), rounded once."""
    m, k = lhs.shape
    g = group_sizes.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    lhs_p, rhs_p, rhs_index, tiles, lora, mp, np_, grid_n, k_steps = _row_operands(
        lhs, rhs, group_sizes, bm, bk, bn, transpose_rhs, rhs_base, lora)
    dtype = lhs.dtype

    def body(group_ref, index_ref, row0_ref, lo_ref, hi_ref, count_ref, lhs_ref, rhs_ref, *refs):
        *lora_refs, out_ref = refs
        count = count_ref[0]

        @plgpu.nd_loop((count * grid_n,), collective_axes="sm")
        def _(info: plgpu.NDLoopInfo):
            ti, ni = _unit(info.index[0], count, grid_n, cfg)
            group, row0, lo, hi = group_ref[ti], row0_ref[ti], lo_ref[ti], hi_ref[ti]

            def unit(*lora_smem):
                return pl.run_scoped(functools.partial(acc_scope, lora_smem=lora_smem), plgpu.ACC((bm, bn)))

            def acc_scope(acc_ref, lora_smem):
                def step(_, a_smem, b_smem):
                    plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)) if transpose_rhs else b_smem)

                if lora_smem:  # the adapter's tiles load while the main product runs
                    _lora_load(*lora_refs, *lora_smem, row0, jnp.minimum(group, g - 1), ni * bn, bm, bn)

                @pl.when(group < g)  # the pseudo-group and the unused tiles multiply nothing: acc stays 0
                def _():
                    plgpu.emit_pipeline(
                        step, grid=(k_steps,), max_concurrent_steps=cfg.stages,
                        in_specs=[
                            plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), delay_release=1,
                                            transforms=_swizzled(bk, dtype)),
                            plgpu.BlockSpec((bn, bk) if transpose_rhs else (bk, bn),
                                            (lambda kk: (ni, kk)) if transpose_rhs else (lambda kk: (kk, ni)),
                                            delay_release=1, transforms=_swizzled(bk if transpose_rhs else bn, dtype)),
                        ],
                    )(lhs_ref.at[pl.ds(pl.multiple_of(row0, _ROW_ALIGN), bm), :], rhs_ref.at[index_ref[ti]])

                if lora_smem:
                    _lora_step(acc_ref, *lora_smem, group < g)
                return acc_ref[...]

            # (the accumulator's registers and shared memory cannot share one scope)
            acc = unit() if lora is None else pl.run_scoped(unit, *_lora_scratch(bm, lora[0].shape[1], bn, dtype))
            _store_rows(acc, out_ref, row0, lo - row0, hi - lo, ni * bn, bm, bn)

    group = tiles[0]
    out = _kernel(body, jax.ShapeDtypeStruct((mp, np_), dtype), interpret, "gmm_rows", cfg.blocks_per_sm)(
        group, rhs_index(group), *tiles[1:], _real_tiles(group, g), lhs_p, rhs_p, *(lora or ()))
    return out[:m, :n]


def _lora_scratch(rows: int, rank: int, cols: int, dtype, copies: int = 1) -> tuple:
    """Shared memory for a fused-adapter step: xa's tile [rows, rank], b's [rank, cols], and their barrier; with
    `copies` > 1 one of each per warpgroup (a leading axis of that size, `copies` barriers)."""
    lead = () if copies == 1 else (copies,)
    return (plgpu.SMEM((*lead, rows, rank), dtype, transforms=_swizzled(rank, dtype)),
            plgpu.SMEM((*lead, rank, cols), dtype, transforms=_swizzled(cols, dtype)),
            plgpu.Barrier(num_arrivals=2, num_barriers=copies))


def _lora_load(xa_ref, b_ref, xa_smem, b_smem, barrier, row0, group, col0, rows: int, cols: int):
    """Start the TMA loads of the adapter's tiles for a unit: xa[row0:row0 + rows], b[group][:, col0:col0 + cols].
    Issued before the main pipeline, so they land while it runs; `_lora_step` waits for them."""
    plgpu.copy_gmem_to_smem(xa_ref.at[pl.ds(pl.multiple_of(row0, _ROW_ALIGN), rows), :], xa_smem, barrier)
    plgpu.copy_gmem_to_smem(b_ref.at[group, :, pl.ds(col0, cols)], b_smem, barrier)


def _lora_step(acc_ref, xa_smem, b_smem, barrier, multiply):
    """acc += xa_tile @ b_tile (one more contraction step, of the adapter's rank) when `multiply`; always waits
    for the loads (the barrier's phase must advance once per unit)."""
    plgpu.barrier_wait(barrier)

    @pl.when(multiply)
    def _():
        plgpu.wgmma(acc_ref, xa_smem, b_smem)
        plgpu.wgmma_wait(0)


def _store_rows_from(o_smem, out_ref, row0, start, size, col0, rows_max: int, block_n: int):
    """TMA-store rows [start, start + size) of the (already written and committed) tile ``o_smem`` to
    out[row0 + start + i, col0:col0 + block_n]; no wait. A TMA store has a static row count, so ``size``
    (at most rows_max) goes out as its binary digits: one store of 2^b rows per set bit b."""
    offset = start
    rows = 1 << (rows_max.bit_length() - 1)
    while rows >= 1:
        @pl.when((size & rows) != 0)
        def _(offset=offset, rows=rows):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(offset, rows)],
                                    out_ref.at[pl.ds(row0 + offset, rows), pl.ds(col0, block_n)])

        offset = offset + (size & rows)
        rows //= 2


def gmm_rows_ws(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, cfg: TileConfig, *,
                transpose_rhs: bool = False, interpret: bool = False, rhs_base=None, lora=None) -> jax.Array:
    """``gmm_rows`` with warp specialisation: a memory warpgroup runs the TMA pipeline, two compute
    warpgroups each own half of the output tile (``cfg.wg_split``) and store their rows while the next tile's
    loads are in flight. Same schedule (``row_tiles``), same results, same ``rhs_base`` and ``lora`` (each compute
    warpgroup loads and multiplies its own half of the adapter's tiles)."""
    m, k = lhs.shape
    g = group_sizes.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    split_n = cfg.wg_split == "n"
    cta_n, wg_m = cfg.cta_n, cfg.wg_m
    lhs_p, rhs_p, rhs_index, tiles, lora, mp, np_, grid_n, k_steps = _row_operands(
        lhs, rhs, group_sizes, bm, bk, cta_n, transpose_rhs, rhs_base, lora)
    dtype = lhs.dtype
    b_block = (cta_n, bk) if transpose_rhs else (bk, cta_n)

    def rhs_tile(rhs_ref, group, ni):
        cols = pl.ds(ni * cta_n, cta_n)
        return rhs_ref.at[group, cols, :] if transpose_rhs else rhs_ref.at[group, :, cols]

    def pipeline(step, context, state=None):
        return plgpu.emit_pipeline_warp_specialized(
            step, grid=(k_steps,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=cfg.stages, compute_context=context, pipeline_state=state,
            in_specs=[
                plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=_swizzled(bk, dtype),
                                memory_space=plgpu.SMEM),
                plgpu.BlockSpec(b_block, (lambda kk: (0, kk)) if transpose_rhs else (lambda kk: (kk, 0)),
                                transforms=_swizzled(bk if transpose_rhs else cta_n, dtype), memory_space=plgpu.SMEM),
            ])

    # Chained pipelines (see the docstring): the memory warpgroup loads the SM's next unit while the compute
    # warpgroups finish this one; JAX allows it when the contraction steps fill the stage ring evenly.
    chained = cfg.chained and k_steps % cfg.stages == 0

    def body(group_ref, index_ref, row0_ref, lo_ref, hi_ref, count_ref, lhs_ref, rhs_ref, *refs):
        *lora_refs, out_ref = refs
        ignore = lambda *_, **__: None
        allocations = pipeline(ignore, ignore).get_allocations(lhs_ref.at[pl.ds(0, bm), :],
                                                                rhs_tile(rhs_ref, 0, 0))
        # Each compute warpgroup's adapter tiles: its wg_m rows of xa, its bn columns of b.
        lora_scratch = {} if lora is None else dict(zip(
            ("xa_smem", "b_smem", "lora_barrier"), _lora_scratch(wg_m, lora[0].shape[1], bn, dtype, copies=2)))

        @functools.partial(pl.run_scoped, allocs=allocations, o_smem=plgpu.SMEM((2, wg_m, bn), dtype),
                           **lora_scratch, collective_axes="wg")
        def _(allocs, o_smem, **lora_smem):
            wg = jax.lax.axis_index("wg")

            # The SM's units: (tile, N-block) pairs of the real tiles only (row_tiles puts them first), so that every
            # unit a chain visits loads and stores (an idle unit between chained pipelines would break the chain).
            count = count_ref[0]

            @plgpu.nd_loop((count * grid_n,), collective_axes="sm")
            def _(info: plgpu.NDLoopInfo):
                ti, ni = _unit(info.index[0], count, grid_n, cfg)
                group, row0, lo, hi = group_ref[ti], row0_ref[ti], lo_ref[ti], hi_ref[ti]
                row_off = 0 if split_n else wg * wg_m  # this warpgroup's rows / columns within the tile
                col0 = ni * cta_n + (wg * bn if split_n else 0)
                first = jnp.clip(lo - row0 - row_off, 0, wg_m)  # the rows of its part that it stores
                last = jnp.clip(hi - row0 - row_off, 0, wg_m)
                # The pseudo-group's rows multiply nothing (acc stays 0), nor does a warpgroup that stores no row:
                # split along M, that is the second half of a group's last tile when the group ends in the first
                # half (half of all last tiles), and the first half of a tile moved back from the end. The other
                # warpgroup then has the tensor cores to itself. Counted in rows multiplied, a group's partial tile
                # then wastes 32 rows on average instead of 64: 13.7% -> 6.8% more products than rows at
                # Qwen3-30B-A3B's 128 groups of ~512 rows in 128-row tiles (its time on the GPU: not yet measured).
                multiply = (group < g) & (last > first)

                def step(_, a_smem, b_smem, acc_ref):
                    a = a_smem if split_n else a_smem.at[pl.ds(wg * wg_m, wg_m)]
                    if transpose_rhs:
                        b = (b_smem.at[pl.ds(wg * bn, bn)] if split_n else b_smem).transpose((1, 0))
                    else:
                        b = b_smem.at[:, pl.ds(wg * bn, bn)] if split_n else b_smem
                    pl.when(multiply)(lambda: plgpu.wgmma(acc_ref, a, b))
                    plgpu.wgmma_wait(0)
                    return acc_ref

                def context(run_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wg_m, bn), jnp.float32))
                    def _(acc_ref):
                        if lora_smem:
                            mine = [lora_smem[k].at[wg] for k in ("xa_smem", "b_smem", "lora_barrier")]
                            _lora_load(*lora_refs, *mine, row0 + row_off, jnp.minimum(group, g - 1), col0, wg_m, bn)
                        run_pipeline(acc_ref)
                        if lora_smem:
                            _lora_step(acc_ref, *mine, multiply)
                        acc = acc_ref[...].astype(dtype)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores left o_smem
                        o_smem[wg] = acc
                        plgpu.commit_smem()
                        _store_rows_from(o_smem.at[wg], out_ref, row0 + row_off, first, last - first, col0,
                                         wg_m, bn)

                def run(state):
                    pipeline(step, context, state)(lhs_ref.at[pl.ds(pl.multiple_of(row0, _ROW_ALIGN), bm), :],
                                                   rhs_tile(rhs_ref, index_ref[ti], ni), allocations=allocs)

                if not chained:
                    run(None)
                    return
                mine, j = info.num_local_steps, info.local_index
                # A chain: the SM's first unit fills the ring (START), the last waits for it to drain (STOP). One
                # unit alone needs both: the unchained pipeline.
                pl.when(mine == 1)(lambda: run(None))
                state = jnp.where(j == 0, int(plgpu.PipelinePipeline.START),
                                  jnp.where(j == mine - 1, int(plgpu.PipelinePipeline.STOP),
                                            int(plgpu.PipelinePipeline.STEADY)))
                pl.when(mine > 1)(lambda: run(state))

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    group = tiles[0]
    out = _kernel(body, jax.ShapeDtypeStruct((mp, np_), dtype), interpret, "gmm_rows_ws", num_threads=3,
                  thread_name="wg")(group, rhs_index(group), *tiles[1:], _real_tiles(group, g), lhs_p, rhs_p,
                                    *(lora or ()))
    return out[:m, :n]
