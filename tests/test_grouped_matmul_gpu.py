"""The Mosaic GPU grouped matmul on the GPU (H100/H200): forward, d lhs and d rhs against the reference on the
MoE expert shapes scaled down (shapes.GPU_TEST_SHAPES: an empty group, tails that are no multiple of a tile,
rows past the last group) and on one full bench shape, against per-group dense matmuls on static row slices; the compiled program is the Mosaic
GPU custom call, not XLA's ragged dot. When they pass, "auto" may take the kernels (api.GPU_FIRST)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.grouped_matmul import grouped_matmul
from kernels_pallas.grouped_matmul.mosaic import TileConfig, gmm_rows, gmm_rows_ws
from kernels_pallas.grouped_matmul.shapes import BENCH_SHAPES, GPU_TEST_SHAPES, make_inputs

pytestmark = pytest.mark.gpu

TOL = 2e-2  # bf16 output (8 mantissa bits) after fp32 accumulation: relative to the largest reference entry
MOSAIC_CALL = r'custom_call_target="mosaic_gpu_v2"'


def _fwd_bwd(impl, sizes):
    def run(lhs, rhs, dout):
        out, pullback = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, implementation=impl), lhs, rhs)
        return (out, *pullback(dout))
    return jax.jit(run)


def _by_slices(lhs, rhs, group_sizes: tuple[int, ...]):
    """The grouped matmul with the group sizes known to Python: one dense matmul per group on its static row
    slice (fp32 accumulation), zero rows past the last group. The oracle here: the same semantics as
    `grouped_matmul_reference`, which computes every group for every row ([M, G, N] fp32: gigabytes at these
    shapes, and more in its gradient), and as `lax.ragged_dot`, whose d rhs took 64 GiB at the bench shapes."""
    parts, start = [], 0
    for g, size in enumerate(group_sizes):
        parts.append(jnp.dot(lhs[start:start + size], rhs[g], preferred_element_type=jnp.float32))
        start += size
    parts.append(jnp.zeros((lhs.shape[0] - start, rhs.shape[2]), jnp.float32))
    return jnp.concatenate(parts).astype(lhs.dtype)


def _fwd_bwd_by_slices(group_sizes: tuple[int, ...]):
    def run(lhs, rhs, dout):
        out, pullback = jax.vjp(lambda a, b: _by_slices(a, b, group_sizes), lhs, rhs)
        return (out, *pullback(dout))
    return jax.jit(run)


def _assert_close(got, want, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    assert err <= TOL * scale, f"{what}: max |err| {err:.4g} > {TOL} * {scale:.4g}"


@pytest.mark.parametrize("shape", GPU_TEST_SHAPES, ids=[s.name for s in GPU_TEST_SHAPES])
def test_kernels_match_the_reference_on_ragged_moe_shapes(shape):
    lhs, rhs, sizes, dout = make_inputs(shape)
    got = _fwd_bwd("pallas_mosaic", sizes)(lhs, rhs, dout)
    want = _fwd_bwd_by_slices(shape.group_sizes)(lhs, rhs, dout)
    for name, g, w in zip(("out", "d lhs", "d rhs"), got, want):
        assert g.dtype == jnp.bfloat16 and g.shape == w.shape
        _assert_close(g, w, f"{shape.name} {name}")
    used = sum(shape.group_sizes)
    assert not np.any(np.asarray(got[0][used:], np.float32)) and not np.any(np.asarray(got[1][used:], np.float32))
    empty = np.asarray(shape.group_sizes) == 0
    assert not np.any(np.asarray(got[2], np.float32)[empty])


VARIANTS = {
    "one_wg": TileConfig(),
    "ws_split_n": TileConfig(warp_specialized=True, wg_split="n", stages=3),
    "ws_split_m": TileConfig(warp_specialized=True, wg_split="m", block_n=192),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_row_kernel_variant_forward_and_transposed(variant):
    """Each row-kernel variant, whatever the tile table picks: forward, and rhs read transposed (as d lhs)."""
    cfg = VARIANTS[variant]
    shape = GPU_TEST_SHAPES[1]  # K 768, N 2048: N not a multiple of 192, so the padded path too
    lhs, rhs, sizes, dout = make_inputs(shape)
    rows = gmm_rows_ws if cfg.warp_specialized else gmm_rows
    want = jax.jit(lambda a, b: _by_slices(a, b, shape.group_sizes))(lhs, rhs)
    _assert_close(jax.jit(lambda a, b, s: rows(a, b, s, cfg))(lhs, rhs, sizes), want, f"{variant} out")
    want_t = jax.jit(lambda a, b: _by_slices(a, jnp.swapaxes(b, 1, 2), shape.group_sizes))(dout, rhs)
    got_t = jax.jit(lambda a, b, s: rows(a, b, s, cfg, transpose_rhs=True))(dout, rhs, sizes)
    _assert_close(got_t, want_t, f"{variant} out with rhs transposed")


def test_full_gpt_oss_down_shape_matches_and_compiles_to_mosaic_gpu():
    shape = next(s for s in BENCH_SHAPES if s.name == "gpt_oss_20b_down")
    lhs, rhs, sizes, dout = make_inputs(shape)
    kernel = _fwd_bwd("pallas_mosaic", sizes)  # by name: "auto" takes it once these tests pass (api.GPU_FIRST)
    got = kernel(lhs, rhs, dout)
    want = _fwd_bwd_by_slices(shape.group_sizes)(lhs, rhs, dout)
    for name, g, w in zip(("out", "d lhs", "d rhs"), got, want):
        _assert_close(g, w, f"{shape.name} {name}")
    hlo = kernel.lower(lhs, rhs, dout).compile().as_text()
    # forward, d lhs, d rhs: three Mosaic GPU kernels and no XLA ragged dot left
    assert len(re.findall(MOSAIC_CALL, hlo)) == 3, re.findall(r'custom_call_target="[^"]+"', hlo)
    assert "ragged" not in hlo


def test_auto_keeps_ragged_dot_for_float32():
    lhs, rhs, sizes, _ = make_inputs(GPU_TEST_SHAPES[0])
    lhs, rhs = lhs.astype(jnp.float32), rhs.astype(jnp.float32)
    hlo = jax.jit(lambda a, b: grouped_matmul(a, b, sizes)).lower(lhs, rhs).compile().as_text()
    assert not re.findall(MOSAIC_CALL, hlo)
