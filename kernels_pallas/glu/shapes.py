"""SwiGLU problem shapes shared by bench.py and the tests: ``gate`` and ``up`` of one shape and dtype.

``TEST_SHAPES``: odd token counts, fp32 and bf16; ``BENCH_SHAPES``: a Llama-3-8B MLP (I = 14336) at 16k
tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class GluShape:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self):
        if not self.shape or not all(isinstance(n, int) and n > 0 for n in self.shape):
            raise ValueError(f"kernels_pallas/glu/shapes.py: GluShape {self.name!r}.shape={self.shape!r} "
                             "must be positive ints.")


TEST_SHAPES: tuple[GluShape, ...] = (
    GluShape("t_mlp_f32", (4, 33, 96)),
    GluShape("t_mlp_bf16", (4, 33, 96), "bfloat16"),
)
BENCH_SHAPES: tuple[GluShape, ...] = (GluShape("mlp_8b_16k", (16384, 14336), "bfloat16"),)


def make_inputs(shape: GluShape, seed: int = 0):
    """``(gate, up, dh)``: gate ~ 3 N(0, 1) (both tails of silu), up and the cotangent ~ N(0, 1)."""
    kg, ku, kd = jax.random.split(jax.random.key(seed), 3)
    dtype = jnp.dtype(shape.dtype)
    gate = (3.0 * jax.random.normal(kg, shape.shape, jnp.float32)).astype(dtype)
    up = jax.random.normal(ku, shape.shape, jnp.float32).astype(dtype)
    dh = jax.random.normal(kd, shape.shape, jnp.float32).astype(dtype)
    return gate, up, dh
