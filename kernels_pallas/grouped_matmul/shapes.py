"""Grouped-matmul problem shapes for the tests and a later bench: ``M`` rows split into ``G`` ragged groups.

``TEST_SHAPES``: small, with empty groups (first, middle and last), uneven sizes and rows left over past the
last group; ``BENCH_SHAPES``: a Qwen3-30B-A3B expert projection (128 experts, top-8, hidden 2048, expert
width 768) at 16k tokens.
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
BENCH_SHAPES: tuple[GmmShape, ...] = (
    GmmShape("qwen3_30b_a3b_up_16k", (1024,) * 128, 16384 * 8, 2048, 768, "bfloat16"),
)


def make_inputs(shape: GmmShape, seed: int = 0):
    """``(lhs, rhs, group_sizes, dout)``: N(0, 1) operands in the shape's dtype, sizes as int32."""
    kl, kr, kd = jax.random.split(jax.random.key(seed), 3)
    dtype = jnp.dtype(shape.dtype)
    g = len(shape.group_sizes)
    lhs = jax.random.normal(kl, (shape.m, shape.k), jnp.float32).astype(dtype)
    rhs = jax.random.normal(kr, (g, shape.k, shape.n), jnp.float32).astype(dtype)
    dout = jax.random.normal(kd, (shape.m, shape.n), jnp.float32).astype(dtype)
    return lhs, rhs, jnp.asarray(np.array(shape.group_sizes, np.int32)), dout
