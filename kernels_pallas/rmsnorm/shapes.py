"""RMSNorm problem shapes shared by bench.py and the tests: ``[..., D]`` activations and a ``[D]`` weight.

``TEST_SHAPES`` cover hidden states (rows not a multiple of 8) and the per-head q/k norm (4-d input);
``BENCH_SHAPES`` are a Llama-3-8B layer's inputs at 16k tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class NormShape:
    name: str
    x_shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self):
        if len(self.x_shape) < 2 or not all(isinstance(n, int) and n > 0 for n in self.x_shape):
            raise ValueError(f"kernels_pallas/rmsnorm/shapes.py: NormShape {self.name!r}.x_shape={self.x_shape!r} "
                             "must be >= 2 positive ints ([..., D]).")


TEST_SHAPES: tuple[NormShape, ...] = (
    NormShape("t_hidden_f32", (3, 37, 64)),
    NormShape("t_heads_f32", (2, 16, 4, 32)),
    NormShape("t_hidden_bf16", (3, 37, 64), "bfloat16"),
    NormShape("t_heads_bf16", (2, 16, 4, 32), "bfloat16"),
)
BENCH_SHAPES: tuple[NormShape, ...] = (
    NormShape("hidden_8b_16k", (16384, 4096), "bfloat16"),
    NormShape("qk_norm_8b_16k", (16384, 32, 128), "bfloat16"),
)


def make_inputs(shape: NormShape, seed: int = 0):
    """``(x, weight, dy)``: x ~ 3 N(0, 1) (RMS far from 1, so the normalisation matters), weight ~ 1 + N(0, 1),
    and an output cotangent; made on the default device."""
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    dtype = jnp.dtype(shape.dtype)
    x = (3.0 * jax.random.normal(kx, shape.x_shape, jnp.float32)).astype(dtype)
    weight = (1.0 + jax.random.normal(kw, shape.x_shape[-1:], jnp.float32)).astype(dtype)
    dy = jax.random.normal(kd, shape.x_shape, jnp.float32).astype(dtype)
    return x, weight, dy
