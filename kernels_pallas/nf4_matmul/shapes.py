"""4-bit matmul problem shapes shared by the tests and bench.py: x [m, in] times W [out, in]^T.

``TEST_SHAPES``: small, odd token counts, a weight whose size is not a multiple of the block, fp32 and bf16;
``BENCH_SHAPES``: the Llama-3.1-8B projections (q/o 4096x4096, k/v 1024x4096, gate/up 14336x4096,
down 4096x14336) at training sizes M = 4096, 8192 and 16384 tokens, bf16.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_8B = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "gate_proj": (14336, 4096), "down_proj": (4096, 14336)}


@dataclasses.dataclass(frozen=True)
class Nf4Shape:
    name: str
    m: int
    out_features: int
    in_features: int
    blocksize: int = 64
    dtype: str = "float32"

    def __post_init__(self):
        if min(self.m, self.out_features, self.in_features, self.blocksize) <= 0:
            raise ValueError(f"kernels_pallas/nf4_matmul/shapes.py: Nf4Shape {self.name!r} needs positive sizes.")


TEST_SHAPES: tuple[Nf4Shape, ...] = (
    Nf4Shape("t_f32", 37, 96, 64),
    Nf4Shape("t_partial_block_f32", 5, 20, 24, 64),
    Nf4Shape("t_bf16", 33, 64, 128, 32, "bfloat16"),
)
BENCH_SHAPES: tuple[Nf4Shape, ...] = tuple(
    Nf4Shape(f"8b_{proj}_{m // 1024}k", m, out_f, in_f, 64, "bfloat16")
    for m in (4096, 8192, 16384) for proj, (out_f, in_f) in _8B.items())


def make_inputs(shape: Nf4Shape, seed: int = 0):
    """``(x, w, dy)``: activations, a float32 weight [out, in] ~ N(0, 0.02) to quantise, and a cotangent."""
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    dtype = jnp.dtype(shape.dtype)
    x = jax.random.normal(kx, (shape.m, shape.in_features), jnp.float32).astype(dtype)
    w = 0.02 * jax.random.normal(kw, (shape.out_features, shape.in_features), jnp.float32)
    dy = jax.random.normal(kd, (shape.m, shape.out_features), jnp.float32).astype(dtype)
    return x, w, dy
