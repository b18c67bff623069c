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

Forward / d-lhs kernel ("row tiles"). Each group's rows are cut into tiles of ``block_m`` rows from the group's
first row, so only a group's last tile is partial; a tile multiplies block_m rows by that group's matrix and stores
only the group's rows (a ladder of power-of-two TMA stores, since a TMA store has a static size). The schedule
(group, first row loaded, first and end row stored, per tile) is computed on the device from group_sizes in plain
jnp (``row_tiles``): at most ``num_row_tiles`` tiles, with the rows past the last group as one extra
pseudo-group whose tiles store zeros; tiles past the real count store nothing. Every SM loops over (tile, N-block)
pairs. (A tile's first loaded row is rounded down to a multiple of 8, which Mosaic GPU needs proven.)

d-rhs kernel ("group tiles"). Every SM loops over (group, K-block, N-block); the pipeline walks the blocks
of ``block_t`` rows that the group's rows touch, and zeroes (in shared memory, before the wgmma) the rows of
its first and last block that belong to a neighbouring group. An empty group runs no step and stores 0.

No host sync: group_sizes stays on the device; one compiled program serves every split. Shapes that do not
fit the tiles (K or N not a multiple of the block, M not a multiple of block_m) are zero-padded here and
sliced back: padded rows fall into the pseudo-group (0), padded contraction columns add 0.

A layer's experts read in place (``grouped_matmul_mosaic(row=)``): rhs is then a stack [L, G, K, N], flattened
to [L * G, K, N] (a reshape, no copy), and the row-tile kernels read matrix ``row * G + group`` through a
per-tile index array made beside the schedule (``_rhs_window``). In a layer scan a slice of the stack handed to
the custom call would be copied out whole first. d rhs is then the layer's [G, K, N] gradient at its row of a
zero stack, which is dead code for frozen experts and compiled away.

Two row-tile kernels: ``gmm_rows`` (one warpgroup issues the TMA loads and the wgmmas) and ``gmm_rows_ws``
(warp-specialised: a memory warpgroup feeds two compute warpgroups that split the tile along N or M and
store their rows while the next tile loads); ``CONFIGS`` picks one per shape. The warp-specialised kernel chains the
pipelines of an SM's units (``TileConfig.chained``, JAX's ``pipeline_state``): the memory warpgroup goes on loading
the next unit while the compute warpgroups finish and store this one, instead of draining the ring after every unit.
Measured on an H200 (the four bench shapes, ragged sizes, kernels queued: docs/benchmarks.md section 35): forward
461-606 TFLOP/s, forward+backward 467-560; the 600 / 500 target is met by GPT-OSS-20B's gate_up forward only and
missed by both Qwen3-30B-A3B shapes (forward 534 and 461; the down shape's K = 768 gives a tile 12 contraction
steps) and GPT-OSS-20B's down forward (593); dense XLA matmuls of the same FLOPs: 704-770 forward. Most
per-entry numbers in ``CONFIGS`` are older sweeps timed one synced call at a time (lower by 6-78%).

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

bf16/f16 operands, fp32 accumulation, output in the input dtype. On CPU the same kernels run in Mosaic
GPU's interpreter (``interpret=True``: the tests; float32 operands are accepted there).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas._dispatch import target_platform

_WHERE = "kernels_pallas/grouped_matmul/mosaic.py"
_INTERPRET_SMS = 2  # "SMs" the interpreter simulates: each one is a thread on the CPU


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tiles of the row-tile kernel (forward, d lhs) and of the group-tile kernel (d rhs).

    block_m x block_n: one output tile (block_m rows of one group); block_k: contraction step.
    dw_block_k x dw_block_n: one tile of d rhs[g]; dw_block_t: rows per contraction step.
    stages: TMA buffers in flight. grid_block_n (row-tile kernels): how many N-blocks the SMs' walk over the (tile,
    N-block) units takes side by side (``plgpu.planar_snake``); 0 (the default): all of a tile's N-blocks before the
    next tile, so the SMs working at once share a few lhs tiles and the expert matrices of a group or two; 1: down
    every tile at one N-block, reading each lhs tile once per N-block. Measured on the H200 (section 25 of
    docs/benchmarks.md), the whole row was faster on 15 of the 16 (shape, direction, tile) pairs, by up to 25%.
    warp_specialized: the row-tile kernel with one memory warpgroup feeding two compute warpgroups, which split
    the output tile along N (wg_split "n": a block_m x 2 block_n tile, block_n each) or along M ("m": a
    block_m x block_n tile, block_m / 2 rows each); else one warpgroup does both (block_m x block_n).
    chained (warp-specialised kernel, when the contraction steps are a multiple of ``stages``): an SM's units run as
    one chain of pipelines, so the memory warpgroup loads the next unit while the compute warpgroups finish and
    store this one; else every unit fills its pipeline from empty and drains it."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    grid_block_n: int = 0
    dw_block_k: int = 128
    dw_block_n: int = 128
    dw_block_t: int = 64
    dw_stages: int = 4
    warp_specialized: bool = False
    wg_split: str = "n"
    chained: bool = True

    def __post_init__(self):
        if self.wg_split not in ("n", "m"):
            raise ValueError(f"{_WHERE}: TileConfig.wg_split must be 'n' or 'm', got {self.wg_split!r}")
        for f in dataclasses.fields(self):
            least = 0 if f.name == "grid_block_n" else 1
            if f.type == "int" and getattr(self, f.name) < least:
                raise ValueError(f"{_WHERE}: TileConfig.{f.name} must be >= {least}, got {getattr(self, f.name)}")
        if self.block_m % self.dw_block_t:
            raise ValueError(f"{_WHERE}: TileConfig.block_m ({self.block_m}) must be a multiple of dw_block_t "
                             f"({self.dw_block_t}): M is padded to block_m for both kernels")


DEFAULT_CONFIG = TileConfig()
_WS = dict(warp_specialized=True)
# Per row-kernel problem (contraction K, output width N, groups G): the forward of a (K, N, G) projection looks
# up (K, N, G), its d lhs (N, K, G); d rhs takes the dw_* fields of the forward's entry. The row-kernel tiles are the
# best of `bench --sweep` on an H200 (JAX 0.11.2, the ragged sizes of shapes.BENCH_SHAPES; each kernel alone,
# TFLOP/s in the comments, the previous table's in brackets; docs/results/gmm_sweep_h200_c957edd.json).
CONFIGS: dict[tuple[int, int, int], TileConfig] = {
    # Qwen3-30B-A3B gate_up [2048 -> 1536]: fwd 408 [382, 335 in a second run], d rhs 366 [341]
    # (gmm_sweep_h200_5369fbf.json); its d lhs (1536 -> 2048): 369 [301]
    (2048, 1536, 128): TileConfig(**_WS, wg_split="m", block_n=192, block_k=64, stages=4, dw_block_k=128,
                                  dw_block_n=192),
    (1536, 2048, 128): TileConfig(**_WS, wg_split="n", stages=3),
    # Qwen3-30B-A3B down [768 -> 2048]: fwd 253 [203], d rhs 282; its d lhs (2048 -> 768): 267 [242]. The queued
    # sweep of 2026-12-05 (gmm_sweep_h200_34003b2.json): fwd split along N, 128 x 128 x 64, 3 stages 446 against
    # the old entry's split along M, 128 x 128 x 128, 2 stages 399; d rhs 128 x 128 in 6 stages 394 against 192 x
    # 128 in 4, 376. No 256-row tile led on any shape.
    (768, 2048, 128): TileConfig(**_WS, wg_split="n", block_k=64, stages=3, dw_block_k=128, dw_block_n=128,
                                 dw_stages=6),
    (2048, 768, 128): TileConfig(**_WS, wg_split="m", block_n=192, stages=4),
    # GPT-OSS-20B gate_up [2880 -> 5760]: fwd 474 [455], d rhs 501; its d lhs (5760 -> 2880): 509 [462]
    (2880, 5760, 32): TileConfig(block_n=192, dw_block_k=192, dw_block_n=128),
    (5760, 2880, 32): TileConfig(block_n=192),
    # GPT-OSS-20B down [2880 -> 2880]: fwd 406 [371], d lhs 399 [359], d rhs 428
    (2880, 2880, 32): TileConfig(block_n=192, dw_block_k=64, dw_block_n=192, dw_stages=6),
}


def _block_for(size: int, preferred: int) -> int:
    """A tile width for a dimension of `size`: 64 for a narrow one, else `preferred` or the first of 128, 192, 64
    that divides it. Why: a dimension that is not a multiple of its tile is zero-padded by a copy of the whole
    operand (and the output sliced back): a d rhs of GPT-OSS's rank-16 expert LoRA on its [16384, 2880] rows with
    128-row tiles copied all of them to [16384, 2944] (the "pad" time of section 22's profile)."""
    if size <= 64:
        return 64
    for block in (preferred, 128, 192, 64):
        if size % block == 0:
            return block
    return preferred


def config_for(k: int, n: int, g: int) -> TileConfig:
    """The table's entry for a (K, N, G) problem, else the default with its widths fitted to K and N."""
    if (k, n, g) in CONFIGS:
        return CONFIGS[(k, n, g)]
    return dataclasses.replace(DEFAULT_CONFIG, block_n=_block_for(n, DEFAULT_CONFIG.block_n),
                               dw_block_n=_block_for(n, DEFAULT_CONFIG.dw_block_n),
                               dw_block_k=_block_for(k, DEFAULT_CONFIG.dw_block_k))


_HOPPER_SMS = 132  # H100 / H200 SXM: the grid when lowering for a GPU from a machine without one


def _num_sms(interpret: bool) -> int:
    if interpret:
        return _INTERPRET_SMS
    return getattr(jax.devices()[0], "core_count", None) or _HOPPER_SMS


def _kernel(body, out_type, interpret: bool, name: str, **threads):
    return plgpu.kernel(body, out_type=out_type, grid=(_num_sms(interpret),), grid_names=("sm",), **threads,
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


# The adapter's rank is zero-padded to 64 columns: a 128-byte swizzled tile. With 16 or 32 (the narrower swizzles)
# Mosaic GPU's layout inference rejects the xa load (JAX 0.11.2, lowered for CUDA from the CPU). The padding
# costs one 64-deep contraction step per output tile (2-3% of the expert shapes' own steps).
_LORA_ALIGN = 64


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
    rhs, rhs_index = _rhs_window(rhs, g, rhs_base, {2: bk, 1: bn} if transpose_rhs else {1: bk, 2: bn})
    lhs_p = _pad(_pad(lhs, 0, bm), 1, bk)
    rhs_p = _pad(_pad(rhs, 2, bk), 1, bn) if transpose_rhs else _pad(_pad(rhs, 1, bk), 2, bn)
    mp, kp = lhs_p.shape
    np_ = rhs_p.shape[1] if transpose_rhs else rhs_p.shape[2]
    tiles = row_tiles(group_sizes, mp, bm)
    grid_n, k_steps = np_ // bn, kp // bk
    dtype = lhs.dtype
    lora = _lora_operands(lora, m, bm, np_, g)

    def body(group_ref, index_ref, row0_ref, lo_ref, hi_ref, count_ref, lhs_ref, rhs_ref, *refs):
        *lora_refs, out_ref = refs
        count = count_ref[0]

        @plgpu.nd_loop((count * grid_n,), collective_axes="sm")
        def _(info: plgpu.NDLoopInfo):
            ti, ni = plgpu.planar_snake(info.index[0], (count, grid_n), 1, cfg.grid_block_n or grid_n)
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
    out = _kernel(body, jax.ShapeDtypeStruct((mp, np_), dtype), interpret, "gmm_rows")(
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
    cta_n, wg_m = (2 * bn, bm) if split_n else (bn, bm // 2)
    rhs, rhs_index = _rhs_window(rhs, g, rhs_base, {2: bk, 1: cta_n} if transpose_rhs else {1: bk, 2: cta_n})
    lhs_p = _pad(_pad(lhs, 0, bm), 1, bk)
    rhs_p = _pad(_pad(rhs, 2, bk), 1, cta_n) if transpose_rhs else _pad(_pad(rhs, 1, bk), 2, cta_n)
    mp, kp = lhs_p.shape
    np_ = rhs_p.shape[1] if transpose_rhs else rhs_p.shape[2]
    tiles = row_tiles(group_sizes, mp, bm)
    grid_n, k_steps = np_ // cta_n, kp // bk
    dtype = lhs.dtype
    b_block = (cta_n, bk) if transpose_rhs else (bk, cta_n)
    lora = _lora_operands(lora, m, bm, np_, g)

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
                ti, ni = plgpu.planar_snake(info.index[0], (count, grid_n), 1, cfg.grid_block_n or grid_n)
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
                    @pl.when(multiply)
                    def _():
                        a = a_smem if split_n else a_smem.at[pl.ds(wg * wg_m, wg_m)]
                        if transpose_rhs:
                            b = (b_smem.at[pl.ds(wg * bn, bn)] if split_n else b_smem).transpose((1, 0))
                        else:
                            b = b_smem.at[:, pl.ds(wg * bn, bn)] if split_n else b_smem
                        plgpu.wgmma(acc_ref, a, b)
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


def gmm_drhs(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, cfg: TileConfig, *,
             interpret: bool = False) -> jax.Array:
    """d rhs[g] = lhs_g^T @ dout_g for lhs [M, K], dout [M, N]: [G, K, N], 0 for empty groups."""
    m, k = lhs.shape
    n = dout.shape[1]
    g = group_sizes.shape[0]
    bt, bk, bn = cfg.dw_block_t, cfg.dw_block_k, cfg.dw_block_n
    lhs_p = _pad(_pad(lhs, 0, cfg.block_m), 1, bk)
    dout_p = _pad(_pad(dout, 0, cfg.block_m), 1, bn)
    kp, np_ = lhs_p.shape[1], dout_p.shape[1]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // bt
    n_blocks = jnp.where(sizes > 0, (ends - 1) // bt - first + 1, 0)
    grid_k, grid_n = kp // bk, np_ // bn
    dtype = lhs.dtype
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
                    def _():
                        # An edge block holds rows of the neighbouring groups: zero them in lhs before the wgmma.
                        rows = plgpu.layout_cast(jax.lax.broadcasted_iota(jnp.int32, (bt, bk), 0),
                                                 plgpu.Layout.WGMMA) + row0
                        keep = ((rows >= start) & (rows < end)).astype(a_smem.dtype)
                        a_smem[...] = a_smem[...] * keep
                        plgpu.commit_smem()

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

            @functools.partial(pl.run_scoped,
                               o_smem=plgpu.SMEM((bk, bn), dtype=dtype, transforms=_swizzled(bn, dtype)))
            def _(o_smem):
                o_smem[...] = acc.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, out_ref.at[gi, pl.ds(ki * bk, bk), pl.ds(ni * bn, bn)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    out = _kernel(body, jax.ShapeDtypeStruct((g, kp, np_), dtype), interpret, "gmm_drhs")(
        starts, ends, first, n_blocks, lhs_p, dout_p)
    return out[:, :k, :n]


def _dlhs_config(cfg_fwd: TileConfig, k: int, n: int, g: int) -> TileConfig:
    """d lhs is a row-tile product with output width K and contraction N: the table's (N, K, G) entry."""
    return CONFIGS.get((n, k, g), dataclasses.replace(cfg_fwd, block_n=_block_for(k, cfg_fwd.block_n)))


def _rows(cfg: TileConfig):
    return gmm_rows_ws if cfg.warp_specialized else gmm_rows


_SMEM_BYTES = 232448 - 256  # an H100/H200 block's shared memory, less what the barriers take


def _padded_rank(rank: int) -> int:
    return -(-rank // _LORA_ALIGN) * _LORA_ALIGN


def smem_bytes(cfg: TileConfig, lora_rank: int = 0, itemsize: int = 2) -> int:
    """Shared memory of a row-kernel launch on `cfg`'s tiles (with a fused adapter of rank `lora_rank`, padded as
    the kernels pad it): the TMA ring, the output staging tile(s) and the adapter's xa / b tiles. The
    single-warpgroup kernel stages its output after the ring's scope has closed, so the two share memory."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    r = _padded_rank(lora_rank) if lora_rank else 0
    if cfg.warp_specialized:
        split_n = cfg.wg_split == "n"
        cta_n, wg_m = (2 * bn, bm) if split_n else (bn, bm // 2)
        ring = cfg.stages * (bm * bk + bk * cta_n)
        return itemsize * (ring + 2 * wg_m * bn + 2 * (wg_m * r + r * bn))
    ring = cfg.stages * (bm * bk + bk * bn) + bm * r + r * bn
    return itemsize * max(ring, bm * bn)


def fused_config(cfg: TileConfig, k: int, rank: int) -> TileConfig | None:
    """`cfg` for a forward of contraction `k` with a fused adapter of rank `rank`: as it is when the adapter's tiles
    fit beside its ring, else with the deepest shallower ring that fits (one whose stage count divides the
    contraction steps, so a warp-specialised kernel still chains), trying 64-deep steps after its own; else None
    (the adapter's product then runs as its own kernel)."""
    for block_k in sorted({cfg.block_k, min(cfg.block_k, 64)}, reverse=True):
        steps = -(-k // block_k)
        for stages in range(cfg.stages, 1, -1):
            if (stages, block_k) != (cfg.stages, cfg.block_k) and cfg.warp_specialized and cfg.chained and \
                    steps % stages:
                continue
            fitted = dataclasses.replace(cfg, stages=stages, block_k=block_k)
            if smem_bytes(fitted, rank) <= _SMEM_BYTES:
                return fitted
    return None


# The fused adapter's kernels ran on the H200 (tests/test_grouped_matmul_gpu.py, tests/test_moe_gpu.py), the d lhs
# kernel with an adapter (`backward_lhs(adapter=)`, the transposed rhs) too since 2026-12-04: GPT-OSS-20B's lean step
# 244.0 -> 240.5 ms and compiled temp 2.23 -> 2.15 GiB against the two kernels (docs/benchmarks.md section 31). The
# flag stays so an A/B against the two-kernel form is one edit.
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
