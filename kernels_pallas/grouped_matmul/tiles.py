"""Tiles of the Mosaic GPU grouped-matmul kernels (`mosaic_kernels`): the per-problem table measured on the H200,
the fallback fitted to a problem's widths, the d lhs lookup, and the shared-memory budget that decides whether an
expert adapter fuses into a row kernel (`fused_config`)."""

from __future__ import annotations

import dataclasses

_WHERE = "kernels_pallas/grouped_matmul/tiles.py"


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
    store this one; else every unit fills its pipeline from empty and drains it.
    blocks_per_sm (single-warpgroup row kernel) and dw_blocks_per_sm (group-tile d rhs): persistent blocks per SM.
    Two, when both fit an SM's shared memory and registers, run at once, each one's pipeline fill, drain and
    stores under the other's products; what the warp-specialised kernel does inside one block, left to the
    hardware. Measured on an H100 (docs/benchmarks.md section 44): the d rhs of both Qwen3-30B-A3B shapes 11-20%
    faster with two (the table's), the row kernels slower than the warp-specialised ones, three blocks slower."""

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
    blocks_per_sm: int = 1
    dw_blocks_per_sm: int = 1

    def __post_init__(self):
        if self.wg_split not in ("n", "m"):
            raise ValueError(f"{_WHERE}: TileConfig.wg_split must be 'n' or 'm', got {self.wg_split!r}")
        for f in dataclasses.fields(self):
            least = 0 if f.name in ("grid_block_n",) else 1
            if f.type == "int" and getattr(self, f.name) < least:
                raise ValueError(f"{_WHERE}: TileConfig.{f.name} must be >= {least}, got {getattr(self, f.name)}")
        if self.block_m % self.dw_block_t:
            raise ValueError(f"{_WHERE}: TileConfig.block_m ({self.block_m}) must be a multiple of dw_block_t "
                             f"({self.dw_block_t}): M is padded to block_m for both kernels")

    @property
    def wg_m(self) -> int:
        """Rows of the output tile one compute warpgroup of the warp-specialised kernel owns: block_m split along N,
        block_m / 2 split along M."""
        return self.block_m if self.wg_split == "n" else self.block_m // 2

    @property
    def cta_n(self) -> int:
        """Output columns one block computes per row tile: 2 block_n for the warp-specialised kernel split along N
        (block_n a compute warpgroup), else block_n."""
        return 2 * self.block_n if self.warp_specialized and self.wg_split == "n" else self.block_n


DEFAULT_CONFIG = TileConfig()
_WS = dict(warp_specialized=True)
# Per row-kernel problem (contraction K, output width N, groups G): the forward of a (K, N, G) projection looks
# up (K, N, G), its d lhs (N, K, G); d rhs takes the dw_* fields of the forward's entry. The row-kernel tiles are the
# best of a tile sweep on an H200 (JAX 0.11.2, the ragged sizes of shapes.BENCH_SHAPES; each kernel alone,
# TFLOP/s in the comments, the previous table's in brackets; docs/results/gmm_sweep_h200_c957edd.json).
CONFIGS: dict[tuple[int, int, int], TileConfig] = {
    # Qwen3-30B-A3B gate_up [2048 -> 1536]: fwd 408 [382, 335 in a second run], d rhs 366 [341]
    # (gmm_sweep_h200_5369fbf.json); its d lhs (1536 -> 2048): 369 [301]
    # d rhs two blocks an SM, 128 x 128 in 3 stages: 459.6 against 413.2 for one block of 128 x 192 in 4 (an H100,
    # one sweep, docs/benchmarks.md section 44)
    (2048, 1536, 128): TileConfig(**_WS, wg_split="m", block_n=192, block_k=64, stages=4, dw_block_k=128,
                                  dw_block_n=128, dw_stages=3, dw_blocks_per_sm=2),
    (1536, 2048, 128): TileConfig(**_WS, wg_split="n", stages=3),
    # Qwen3-30B-A3B down [768 -> 2048]: fwd 253 [203], d rhs 282; its d lhs (2048 -> 768): 267 [242]. The queued
    # sweep of 2026-12-05 (gmm_sweep_h200_34003b2.json): fwd split along N, 128 x 128 x 64, 3 stages 446 against
    # the old entry's split along M, 128 x 128 x 128, 2 stages 399; d rhs 128 x 128 in 6 stages 394 against 192 x
    # 128 in 4, 376. No 256-row tile led on any shape.
    # d rhs two blocks an SM in 3 stages: 452.5 against 375.5 for one block in 6 (an H100, section 44)
    (768, 2048, 128): TileConfig(**_WS, wg_split="n", block_k=64, stages=3, dw_block_k=128, dw_block_n=128,
                                 dw_stages=3, dw_blocks_per_sm=2),
    (2048, 768, 128): TileConfig(**_WS, wg_split="m", block_n=192, stages=4),
    # GPT-OSS-20B gate_up [2880 -> 5760]: fwd 474 [455], d rhs 501; its d lhs (5760 -> 2880): 509 [462]
    (2880, 5760, 32): TileConfig(block_n=192, dw_block_k=192, dw_block_n=128),
    (5760, 2880, 32): TileConfig(block_n=192),
    # GPT-OSS-20B down [2880 -> 2880]: fwd 406 [371], d lhs 399 [359], d rhs 428. Two blocks an SM in 2 stages led a
    # sweep on an H100 by 2-3% and tied in the A/B after it (fwd 523.1 against 527.2, section 44): one block.
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


def _dlhs_config(cfg_fwd: TileConfig, k: int, n: int, g: int) -> TileConfig:
    """d lhs is a row-tile product with output width K and contraction N: the table's (N, K, G) entry."""
    return CONFIGS.get((n, k, g), dataclasses.replace(cfg_fwd, block_n=_block_for(k, cfg_fwd.block_n)))


# The adapter's rank is zero-padded to 64 columns: a 128-byte swizzled tile. With 16 or 32 (the narrower swizzles)
# Mosaic GPU's layout inference rejects the xa load (JAX 0.11.2, lowered for CUDA from the CPU). The padding
# costs one 64-deep contraction step per output tile (2-3% of the expert shapes' own steps).
_LORA_ALIGN = 64


_SM_SMEM_BYTES = 233472  # an H100/H200 SM's shared memory, 228 KiB: what co-resident blocks share
_BLOCK_RESERVED = 1024 + 256  # per block: the runtime's reserved 1 KiB, barriers
_SMEM_BYTES = _SM_SMEM_BYTES - _BLOCK_RESERVED  # one block's: 232,448 (227 KiB) less what the barriers take


def _padded_rank(rank: int) -> int:
    return -(-rank // _LORA_ALIGN) * _LORA_ALIGN


def smem_bytes(cfg: TileConfig, lora_rank: int = 0, itemsize: int = 2) -> int:
    """Shared memory of a row-kernel launch on `cfg`'s tiles (with a fused adapter of rank `lora_rank`, padded as
    the kernels pad it): the TMA ring, the output staging tile(s) and the adapter's xa / b tiles. The
    single-warpgroup kernel stages its output after the ring's scope has closed, so the two share memory."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    r = _padded_rank(lora_rank) if lora_rank else 0
    if cfg.warp_specialized:
        wg_m = cfg.wg_m
        ring = cfg.stages * (bm * bk + bk * cfg.cta_n)
        return itemsize * (ring + 2 * wg_m * bn + 2 * (wg_m * r + r * bn))
    ring = cfg.stages * (bm * bk + bk * bn) + bm * r + r * bn
    return itemsize * max(ring, bm * bn)


def fused_config(cfg: TileConfig, k: int, rank: int) -> TileConfig | None:
    """`cfg` for a forward of contraction `k` with a fused adapter of rank `rank`: as it is when the adapter's tiles
    fit beside its ring, else with the deepest shallower ring that fits (one whose stage count divides the
    contraction steps, so a warp-specialised kernel still chains), trying 64-deep steps after its own; else None
    (the adapter's product then runs as its own kernel). Several blocks an SM (`blocks_per_sm`) stay only while they
    fit the SM with the adapter's tiles; else one block, whose ring may then be as deep as the entry's shared memory
    for all its blocks allows."""
    if cfg.blocks_per_sm > 1:
        together = _fitted_ring(cfg, k, rank)
        if together is not None and blocks_fit(smem_bytes(together, rank), cfg.blocks_per_sm):
            return together
        alone = dataclasses.replace(cfg, blocks_per_sm=1)
        deepest = max(st for st in range(cfg.stages, 9) if smem_bytes(dataclasses.replace(alone, stages=st)) <=
                      cfg.blocks_per_sm * smem_bytes(cfg))
        cfg = dataclasses.replace(alone, stages=deepest)
    return _fitted_ring(cfg, k, rank)


def _fitted_ring(cfg: TileConfig, k: int, rank: int) -> TileConfig | None:
    """`fused_config`'s search for one block: the deepest ring that fits beside the adapter's tiles."""
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


def blocks_fit(smem: int, blocks: int) -> bool:
    """Whether `blocks` blocks of `smem` bytes of shared memory each fit on one SM together."""
    return blocks * (smem + _BLOCK_RESERVED) <= _SM_SMEM_BYTES


def drhs_smem_bytes(cfg: TileConfig, itemsize: int = 2) -> int:
    """Shared memory of a d rhs launch on `cfg`'s dw_* tiles: the TMA ring, or the output staging tile (staged after
    the ring's scope has closed, in the same memory) where that is larger."""
    ring = cfg.dw_stages * cfg.dw_block_t * (cfg.dw_block_k + cfg.dw_block_n)
    return itemsize * max(ring, cfg.dw_block_k * cfg.dw_block_n)
