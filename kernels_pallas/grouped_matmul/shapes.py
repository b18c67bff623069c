"""Grouped-matmul problem shapes for the tests and a later bench: ``M`` rows split into ``G`` ragged groups.

``TEST_SHAPES``: small, with empty groups (first, middle and last), uneven sizes and rows left over past the
last group. ``BENCH_SHAPES``: the expert projections of Qwen3-30B-A3B (128 experts, top-8, hidden 2048,
expert width 768: gate+up [2048 -> 1536], down [768 -> 2048]) at 8k tokens (65536 routed rows) and of
GPT-OSS-20B (32 experts, top-4, hidden 2880, expert width 2880: gate_up [2880 -> 5760], down [2880 -> 2880])
at 8k tokens (32768 rows), with ragged (fixed-seed, +-50 %) group sizes like a real router's.
``GPU_TEST_SHAPES``: the same projections (same K and N) at 16 / 8 experts and ~1k / 600 rows, ragged sizes with
empty groups and rows left over past the last group, for the GPU tests, which run them on the tile configs of the
full shapes (``GPU_TEST_TILES_OF``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class GmmShape:
    name: str
    group_sizes: tuple[int, ...]  # rows per group, in order; sum <= m
    m: int
    k: int
    n: int
    dtype: str = "float32"

    def __post_init__(self):
        if any(g < 0 for g in self.group_sizes) or sum(self.group_sizes) > self.m or min(self.m, self.k, self.n) <= 0:
            raise ValueError(f"kernels_pallas/grouped_matmul/shapes.py: GmmShape {self.name!r} needs group sizes >= 0 "
                             f"summing to at most m={self.m} and positive m, k, n.")


TEST_SHAPES: tuple[GmmShape, ...] = (
    GmmShape("t_ragged_empty_f32", (0, 5, 0, 1, 9, 0), 15, 24, 40),
    GmmShape("t_leftover_rows_f32", (3, 0, 4), 10, 16, 8),
    GmmShape("t_ragged_bf16", (7, 0, 2, 11), 20, 32, 48, "bfloat16"),
)


def ragged_sizes(rows: int, groups: int, seed: int = 0) -> tuple[int, ...]:
    """``groups`` sizes summing to ``rows``, each within about +-50 % of the mean (fixed seed)."""
    w = np.random.default_rng(seed).uniform(0.5, 1.5, groups)
    sizes = np.floor(w / w.sum() * rows).astype(np.int64)
    sizes[: rows - int(sizes.sum())] += 1
    return tuple(int(x) for x in sizes)


BENCH_SHAPES: tuple[GmmShape, ...] = (
    GmmShape("qwen3_30b_a3b_gate_up", ragged_sizes(65536, 128), 65536, 2048, 1536, "bfloat16"),
    GmmShape("qwen3_30b_a3b_down", ragged_sizes(65536, 128), 65536, 768, 2048, "bfloat16"),
    GmmShape("gpt_oss_20b_gate_up", ragged_sizes(32768, 32), 32768, 2880, 5760, "bfloat16"),
    GmmShape("gpt_oss_20b_down", ragged_sizes(32768, 32), 32768, 2880, 2880, "bfloat16"),
)


def _with_gaps(sizes: tuple[int, ...], empty: tuple[int, ...], extra: int) -> tuple[int, ...]:
    """``sizes`` with the groups at ``empty`` set to 0 and ``extra`` more rows on the first group left."""
    out = [0 if i in empty else x for i, x in enumerate(sizes)]
    out[next(i for i in range(len(out)) if i not in empty)] += extra
    return tuple(out)


GPU_TEST_SHAPES: tuple[GmmShape, ...] = (
    GmmShape("g_qwen_gate_up", _with_gaps(ragged_sizes(1000, 16, 1), (0, 5, 15), 3), 1024, 2048, 1536, "bfloat16"),
    GmmShape("g_qwen_down", _with_gaps(ragged_sizes(1000, 16, 2), (8,), 1), 1024, 768, 2048, "bfloat16"),
    GmmShape("g_gpt_oss_gate_up", _with_gaps(ragged_sizes(600, 8, 3), (1, 7), 5), 640, 2880, 5760, "bfloat16"),
    GmmShape("g_gpt_oss_down", _with_gaps(ragged_sizes(600, 8, 4), (0,), 7), 640, 2880, 2880, "bfloat16"),
)
# The bench shape whose tile configs (tiles.CONFIGS, keyed by K, N and the expert count) each GPU test shape runs:
# the same K and N at fewer experts and rows, so the host oracle and the expert weights (up to 1 GiB at 32 experts)
# stay small while every kernel variant of the full shapes is compiled and checked.
GPU_TEST_TILES_OF: dict[str, GmmShape] = dict(zip((t.name for t in GPU_TEST_SHAPES), BENCH_SHAPES))  # in order


def make_inputs(shape: GmmShape, seed: int = 0):
    """``(lhs, rhs, group_sizes, dout)``: N(0, 1) operands in the shape's dtype, sizes as int32."""
    kl, kr, kd = jax.random.split(jax.random.key(seed), 3)
    dtype = jnp.dtype(shape.dtype)
    g = len(shape.group_sizes)
    lhs = jax.random.normal(kl, (shape.m, shape.k), jnp.float32).astype(dtype)
    rhs = jax.random.normal(kr, (g, shape.k, shape.n), jnp.float32).astype(dtype)
    dout = jax.random.normal(kd, (shape.m, shape.n), jnp.float32).astype(dtype)
    return lhs, rhs, jnp.asarray(np.array(shape.group_sizes, np.int32)), dout
