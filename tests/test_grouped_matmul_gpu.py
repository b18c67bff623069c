"""The Mosaic GPU grouped matmul on the GPU (H100/H200): forward, d lhs and d rhs against the reference on the
MoE expert shapes scaled down (shapes.GPU_TEST_SHAPES: the full shapes' K, N and tile configs at fewer experts and
rows; an empty group, tails that are no multiple of a tile, rows past the last group) and, through
`grouped_matmul`, on one full bench shape (three of its groups checked), against per-group numpy products; the
compiled program is the Mosaic GPU custom call, not XLA's ragged dot; "auto" takes them for bf16 (they passed at
ed4a32e) and not for float32."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.grouped_matmul import grouped_matmul
from kernels_pallas.grouped_matmul import mosaic, tiles
from kernels_pallas.grouped_matmul.tiles import TileConfig
from kernels_pallas.grouped_matmul.mosaic_kernels import gmm_rows, gmm_rows_ws
from kernels_pallas.grouped_matmul.shapes import BENCH_SHAPES, GPU_TEST_SHAPES, GPU_TEST_TILES_OF, GmmShape, make_inputs
from gpu_helpers import NO_AUTOTUNE

pytestmark = pytest.mark.gpu

TOL = 2e-2  # bf16 output (8 mantissa bits) after fp32 accumulation: relative to the largest reference entry
MOSAIC_CALL = r'custom_call_target="mosaic_gpu_v2"'


def _fwd_bwd(impl, sizes):
    def run(lhs, rhs, dout):
        out, pullback = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, implementation=impl), lhs, rhs)
        return (out, *pullback(dout))
    return jax.jit(run)


def _numpy_fwd_bwd(lhs, rhs, dout, group_sizes: tuple[int, ...], groups=None):
    """Out, d lhs and d rhs of the grouped matmul in numpy fp32, one dense product per group on its row slice (rows
    past the last group: zero). The oracle here, on the host: `grouped_matmul_reference` computes every group for
    every row ([M, G, N] fp32: gigabytes at these shapes, more in its gradient) and `lax.ragged_dot`'s d rhs took
    64 GiB at the bench shapes; a jitted loop of per-group slices compiles for tens of seconds at 128 groups.
    `groups`: only these groups' rows and weights are filled (the rest stay zero, for a partial check)."""
    lhs, rhs, dout = (np.asarray(x, np.float32) for x in (lhs, rhs, dout))
    out, dlhs, drhs = np.zeros((lhs.shape[0], rhs.shape[2]), np.float32), np.zeros_like(lhs), np.zeros_like(rhs)
    starts = np.concatenate([[0], np.cumsum(group_sizes)])
    for g in range(len(group_sizes)) if groups is None else groups:
        rows = slice(int(starts[g]), int(starts[g + 1]))
        out[rows] = lhs[rows] @ rhs[g]
        dlhs[rows] = dout[rows] @ rhs[g].T
        drhs[g] = lhs[rows].T @ dout[rows]
    return out, dlhs, drhs


def _assert_close(got, want, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    assert err <= TOL * scale, f"{what}: max |err| {err:.4g} > {TOL} * {scale:.4g}"


def _fwd_bwd_on_tiles_of(full: GmmShape, sizes):
    """Forward, d lhs and d rhs by the kernels of `grouped_matmul`'s custom VJP (mosaic.forward / backward), on the
    tile configs the table gives the full shape `full` (keyed by its K, N and expert count), for operands of
    fewer experts and rows."""
    key = (full.k, full.n, len(full.group_sizes))
    assert key in tiles.CONFIGS  # a tuned entry, not the default

    def run(lhs, rhs, dout):
        return mosaic.forward(lhs, rhs, sizes, key), *mosaic.backward(lhs, rhs, sizes, dout, key)
    return jax.jit(run)


@pytest.mark.parametrize("shape", GPU_TEST_SHAPES, ids=[s.name for s in GPU_TEST_SHAPES])
def test_kernels_match_the_reference_on_ragged_moe_shapes(shape):
    full = GPU_TEST_TILES_OF[shape.name]
    assert (shape.k, shape.n) == (full.k, full.n)
    lhs, rhs, sizes, dout = make_inputs(shape)
    got = _fwd_bwd_on_tiles_of(full, sizes)(lhs, rhs, dout)
    want = _numpy_fwd_bwd(lhs, rhs, dout, shape.group_sizes)
    for name, g, w in zip(("out", "d lhs", "d rhs"), got, want):
        assert g.dtype == jnp.bfloat16 and g.shape == w.shape
        _assert_close(g, w, f"{shape.name} {name}")
    used = sum(shape.group_sizes)
    assert not np.any(np.asarray(got[0][used:], np.float32)) and not np.any(np.asarray(got[1][used:], np.float32))
    empty = np.asarray(shape.group_sizes) == 0
    assert not np.any(np.asarray(got[2], np.float32)[empty])


@pytest.mark.parametrize("shape", GPU_TEST_SHAPES[:3], ids=[s.name for s in GPU_TEST_SHAPES[:3]])
def test_a_fused_adapter_matches_on_the_tiles_of_each_projection(shape):
    """The row kernel with a rank-16 adapter fused into its accumulator (`lora=`) on the full shape's tiles as
    `fused_config` fits them, against numpy: gmm(lhs, rhs) + gmm(xa, b); one Mosaic GPU kernel. (mosaic.forward
    takes this path on a GPU once FUSED_LORA_ON_GPU is set.)"""
    full = GPU_TEST_TILES_OF[shape.name]
    key = (full.k, full.n, len(full.group_sizes))
    cfg = tiles.fused_config(tiles.config_for(*key), key[0], 16)
    lhs, rhs, sizes, _ = make_inputs(shape)
    k1, k2 = jax.random.split(jax.random.key(9))
    xa = jax.random.normal(k1, (shape.m, 16), jnp.float32).astype(jnp.bfloat16)
    b = (jax.random.normal(k2, (len(shape.group_sizes), 16, shape.n), jnp.float32) * 0.25).astype(jnp.bfloat16)
    rows = gmm_rows_ws if cfg.warp_specialized else gmm_rows
    kernel = jax.jit(lambda a, w, s, x, bb: rows(a, w, s, cfg, lora=(x, bb))).lower(lhs, rhs, sizes, xa, b).compile()
    got = kernel(lhs, rhs, sizes, xa, b)
    zeros = np.zeros((shape.m, shape.n), np.float32)
    want = _numpy_fwd_bwd(lhs, rhs, zeros, shape.group_sizes)[0] + _numpy_fwd_bwd(xa, b, zeros, shape.group_sizes)[0]
    _assert_close(got, want, f"{shape.name} out with the adapter")
    assert not np.any(np.asarray(got[sum(shape.group_sizes):], np.float32))
    assert len(re.findall(MOSAIC_CALL, kernel.as_text())) == 1


DOWN_SHAPES = [s for s in GPU_TEST_SHAPES if s.name.endswith("_down")]


@pytest.mark.parametrize("shape", DOWN_SHAPES, ids=[s.name for s in DOWN_SHAPES])
def test_an_adapter_fused_into_the_d_lhs_kernel_matches_on_the_down_tiles(shape):
    """`backward_lhs(adapter=)` with the fusion forced on (interpret=False, FUSED_DLHS_LORA_ON_GPU or not): d lhs =
    dout @ rhs^T + d xa @ a^T per group in ONE Mosaic GPU kernel on the down projections' d lhs tiles as
    `fused_config` fits them, against numpy. (mosaic._gmm_adapted's backward takes this path on a GPU once
    FUSED_DLHS_LORA_ON_GPU is set.)"""
    full = GPU_TEST_TILES_OF[shape.name]
    key = (full.k, full.n, len(full.group_sizes))
    cfg = tiles.fused_config(tiles._dlhs_config(tiles.config_for(*key), *key), key[1], 16)
    assert cfg is not None
    _, rhs, sizes, dout = make_inputs(shape)
    g = len(shape.group_sizes)
    k1, k2 = jax.random.split(jax.random.key(10))
    dxa = jax.random.normal(k1, (shape.m, 16), jnp.float32).astype(jnp.bfloat16)
    a = (jax.random.normal(k2, (g, shape.k, 16), jnp.float32) * 0.25).astype(jnp.bfloat16)
    rows = gmm_rows_ws if cfg.warp_specialized else gmm_rows
    kernel = jax.jit(lambda d, w, s, x, at: rows(d, w, s, cfg, transpose_rhs=True, lora=(x, at))).lower(
        dout, rhs, sizes, dxa, jnp.swapaxes(a, 1, 2)).compile()
    got = kernel(dout, rhs, sizes, dxa, jnp.swapaxes(a, 1, 2))
    want = _numpy_fwd_bwd(np.zeros((shape.m, shape.k), np.float32), rhs, dout, shape.group_sizes)[1] + \
        _numpy_fwd_bwd(np.zeros((shape.m, shape.k), np.float32), a, dxa, shape.group_sizes)[1]
    _assert_close(got, want, f"{shape.name} d lhs with the adapter")
    assert not np.any(np.asarray(got[sum(shape.group_sizes):], np.float32))
    assert len(re.findall(MOSAIC_CALL, kernel.as_text())) == 1


VARIANTS = {
    "one_wg": TileConfig(),
    "ws_split_n": TileConfig(warp_specialized=True, wg_split="n", stages=3),
    "ws_split_m": TileConfig(warp_specialized=True, wg_split="m", block_n=192),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_row_kernel_variant_forward_and_transposed(variant):
    """Each row-kernel variant, whatever the tile table picks: forward, and rhs read transposed (as d lhs)."""
    cfg = VARIANTS[variant]
    shape = GPU_TEST_SHAPES[1]  # K 768, N 2048: N not a multiple of 192, so the padded path too; 16 ragged groups
    lhs, rhs, sizes, dout = make_inputs(shape)
    rows = gmm_rows_ws if cfg.warp_specialized else gmm_rows
    want, want_t, _ = _numpy_fwd_bwd(lhs, rhs, dout, shape.group_sizes)  # d lhs = dout @ rhs^T per group
    _assert_close(jax.jit(lambda a, b, s: rows(a, b, s, cfg))(lhs, rhs, sizes), want, f"{variant} out")
    got_t = jax.jit(lambda a, b, s: rows(a, b, s, cfg, transpose_rhs=True))(dout, rhs, sizes)
    _assert_close(got_t, want_t, f"{variant} out with rhs transposed")


def test_full_gpt_oss_down_shape_matches_and_compiles_to_mosaic_gpu():
    shape = next(s for s in BENCH_SHAPES if s.name == "gpt_oss_20b_down")
    lhs, rhs, sizes, dout = make_inputs(shape)
    kernel = _fwd_bwd("pallas_mosaic", sizes).lower(lhs, rhs, dout).compile()  # one compile: run and HLO
    got = kernel(lhs, rhs, dout)
    checked = (0, 1, len(shape.group_sizes) - 1)  # three groups' rows and weights: the full oracle is ~1.6 TFLOP
    want = _numpy_fwd_bwd(lhs, rhs, dout, shape.group_sizes, groups=checked)
    starts = np.concatenate([[0], np.cumsum(shape.group_sizes)])
    rows = np.concatenate([np.arange(starts[g], starts[g + 1]) for g in checked])
    for name, g, w in zip(("out", "d lhs"), got, want):
        _assert_close(np.asarray(g, np.float32)[rows], w[rows], f"{shape.name} {name}")
    _assert_close(np.asarray(got[2], np.float32)[list(checked)], want[2][list(checked)], f"{shape.name} d rhs")
    hlo = kernel.as_text()
    # forward, d lhs, d rhs: three Mosaic GPU kernels and no XLA ragged dot left
    assert len(re.findall(MOSAIC_CALL, hlo)) == 3, re.findall(r'custom_call_target="[^"]+"', hlo)
    assert "ragged" not in hlo


def test_auto_takes_the_kernels_for_bf16_and_keeps_ragged_dot_for_float32():
    # A small shape compiled without autotuning: XLA's ragged-dot autotuner ran out of a test worker's memory
    # (4 GiB scratch) at the GPU test shapes on the H200.
    lhs, rhs, sizes, _ = make_inputs(GmmShape("g_auto", (100, 0, 60), 256, 128, 256, "bfloat16"))
    def hlo(a, b):
        return jax.jit(lambda x, y: grouped_matmul(x, y, sizes)).lower(a, b).compile(
            compiler_options=NO_AUTOTUNE).as_text()
    assert re.findall(MOSAIC_CALL, hlo(lhs, rhs))
    assert not re.findall(MOSAIC_CALL, hlo(lhs.astype(jnp.float32), rhs.astype(jnp.float32)))


# Grid cases of the Mosaic GPU kernels, native here (interpreted on the CPU each costs seconds); the CPU suite
# (tests/test_grouped_matmul.py) keeps one interpreted case per kernel variant.


def _bf16_operands(m: int, k: int, n: int, g: int, seed: int):
    ks = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
                 for key, shape in zip(ks, ((m, k), (g, k, n), (m, n))))


@pytest.mark.parametrize("k,n", [(192, 16), (16, 192)])
def test_default_tiles_of_a_rank_16_adapter_match(k, n):
    """The default tiles of a rank-16 expert LoRA's shapes (tests/test_grouped_matmul.py checks they divide the
    wide side): forward and both gradients through `grouped_matmul` against the per-group loop."""
    group_sizes = (50, 0, 61, 17)
    lhs, rhs, dout = _bf16_operands(140, k, n, 4, 5)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    got = _fwd_bwd("pallas_mosaic", sizes)(lhs, rhs, dout)
    for name, g, w in zip(("out", "d lhs", "d rhs"), got, _numpy_fwd_bwd(lhs, rhs, dout, group_sizes)):
        _assert_close(g, w, f"({k}, {n}) {name}")


def test_256_row_warp_specialised_tiles_split_along_m_match():
    """256-row tiles split along M (128 rows a compute warpgroup, a sweep candidate): groups of one, two and three
    halves, an empty one, and rows past the last group."""
    group_sizes = (300, 0, 140, 3, 0, 50)
    m = sum(group_sizes) + 7
    cfg = TileConfig(block_m=256, block_n=64, block_k=64, stages=2, warp_specialized=True, wg_split="m")
    lhs, rhs, _ = _bf16_operands(m, 128, 128, 6, 4)
    got = jax.jit(lambda a, b, s: gmm_rows_ws(a, b, s, cfg))(lhs, rhs, jnp.asarray(group_sizes, jnp.int32))
    _assert_close(got, _numpy_fwd_bwd(lhs, rhs, np.zeros((m, 128)), group_sizes)[0], "out, 256-row tiles")


@pytest.mark.parametrize("group_sizes,m,k,n,walk", [
    ((64,), 64, 128, 64, 1),  # one unit: one SM runs it unchained, the others have none
    ((60, 60), 128, 128, 64, 1),  # 3 tiles (with the 8 rows past the groups)
    ((70, 0, 61, 3, 0, 50), 200, 192, 64, 1),  # 3 steps on 2 stages: no chain, every unit fills and drains
    ((70, 0, 61, 3, 0, 50), 200, 128, 256, 2),  # 4 N-blocks walked two side by side
    ((70, 0, 61, 3, 0, 50), 200, 128, 128, 1),  # down the tiles at one N-block (of 2)
    # the last group's tile moved back from the end (rows 64-127): its first half stores no row and multiplies
    # nothing, the second half does
    ((100, 20), 120, 128, 64, 0),
])
def test_warp_specialised_chains_of_pipelines_match(group_sizes, m, k, n, walk):
    """The chained pipelines of the warp-specialised row kernel (TileConfig.chained) on the walks over the N-blocks
    (grid_block_n: 0 a tile's whole row, 1 down the tiles, 2 two side by side) and their edge cases."""
    cfg = TileConfig(block_m=64, block_n=64, block_k=64, stages=2, warp_specialized=True, wg_split="m",
                     grid_block_n=walk)
    lhs, rhs, _ = _bf16_operands(m, k, n, len(group_sizes), 6)
    got = jax.jit(lambda a, b, s: gmm_rows_ws(a, b, s, cfg))(lhs, rhs, jnp.asarray(group_sizes, jnp.int32))
    _assert_close(got, _numpy_fwd_bwd(lhs, rhs, np.zeros((m, n)), group_sizes)[0], f"out (K {k}, N {n}, walk {walk})")


def test_two_blocks_an_sm_match():
    """TileConfig.blocks_per_sm / dw_blocks_per_sm = 2: the row kernel forward and with rhs read transposed (d lhs),
    and the group-tile d rhs, on ragged groups with empty ones and rows past the last."""
    from kernels_pallas.grouped_matmul.mosaic_drhs import gmm_drhs

    cfg = TileConfig(block_m=64, block_n=64, block_k=64, stages=2, blocks_per_sm=2, dw_block_k=64, dw_block_n=64,
                     dw_block_t=64, dw_stages=2, dw_blocks_per_sm=2)
    group_sizes = (70, 0, 61, 3, 0, 50)
    lhs, rhs, dout = _bf16_operands(200, 128, 128, 6, 8)
    sizes = jnp.asarray(group_sizes, jnp.int32)
    want_out, want_dlhs, want_drhs = _numpy_fwd_bwd(lhs, rhs, dout, group_sizes)
    _assert_close(jax.jit(lambda a, b, s: gmm_rows(a, b, s, cfg))(lhs, rhs, sizes), want_out, "out")
    got = jax.jit(lambda d, b, s: gmm_rows(d, b, s, cfg, transpose_rhs=True))(dout, rhs, sizes)
    _assert_close(got, want_dlhs, "d lhs")
    _assert_close(jax.jit(lambda a, d, s: gmm_drhs(a, d, s, cfg))(lhs, dout, sizes), want_drhs, "d rhs")
