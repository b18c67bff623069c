"""Linear cross-entropy problem shapes shared by the benchmark (bench.py) and the tests.

``SHAPES`` are the GPU benchmark heads (Llama 3 / Qwen3 / Gemma 2 vocabularies, 16k tokens);
``SMOKE_SHAPE`` is a CPU-sized run of the benchmark; ``TEST_SHAPES`` are the CPU test problems every
implementation is compared on (a chunk remainder, a soft-cap, bf16); ``GPU_TEST_SHAPES`` the device's.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class BenchShape:
    """One problem size: ``hidden [num_tokens, hidden]``, ``weight [hidden, vocab]``."""

    name: str
    num_tokens: int
    hidden: int
    vocab: int
    dtype: str = "bfloat16"
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        for field in ("num_tokens", "hidden", "vocab"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"kernels_pallas/linear_cross_entropy/shapes.py: BenchShape "
                    f"{self.name!r}.{field} must be a positive int, got {value!r}."
                )
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(
                f"kernels_pallas/linear_cross_entropy/shapes.py: BenchShape "
                f"{self.name!r}.dtype must be 'bfloat16' or 'float32', got {self.dtype!r}."
            )

    @property
    def full_logits_bytes(self) -> int:
        return self.num_tokens * self.vocab * 4


SHAPES: tuple[BenchShape, ...] = (
    BenchShape("llama3-8b", 16384, 4096, 128256),
    BenchShape("qwen3-8b", 16384, 4096, 151936),
    BenchShape("gemma2-9b-softcap", 16384, 3584, 256000, logit_softcap=30.0),
)
SMOKE_SHAPE = BenchShape("smoke", 300, 32, 1000, dtype="float32", logit_softcap=30.0)

TEST_SHAPES: tuple[BenchShape, ...] = (
    BenchShape("t_f32", 67, 32, 301, dtype="float32"),
    BenchShape("t_f32_softcap", 67, 32, 301, dtype="float32", logit_softcap=2.5),
    BenchShape("t_bf16_softcap", 53, 24, 211, dtype="bfloat16", logit_softcap=3.0),
)
GPU_TEST_SHAPES: tuple[BenchShape, ...] = (
    BenchShape("g_f32_softcap", 2000, 512, 32000, dtype="float32", logit_softcap=30.0),
    BenchShape("g_bf16_softcap", 2000, 512, 32000, dtype="bfloat16", logit_softcap=30.0),
)


def make_test_problem(shape: BenchShape, seed: int = 0):
    """``(hidden, weight, targets, weights)`` for tests, from numpy on the host: weight scaled so logits are
    O(few) (a soft-cap of 2-3 bends them), weights in [0.5, 2] with a quarter of the tokens ignored (weight 0,
    target -100, the HF ignore id, which must be harmless)."""
    rng = np.random.default_rng(seed)
    n, h, v = shape.num_tokens, shape.hidden, shape.vocab
    hidden = rng.standard_normal((n, h)).astype(np.float32)
    weight = (rng.standard_normal((h, v)) * 1.5 / np.sqrt(h)).astype(np.float32)
    targets = rng.integers(0, v, size=n).astype(np.int32)
    weights = rng.uniform(0.5, 2.0, size=n).astype(np.float32)
    ignored = rng.random(n) < 0.25
    ignored[0] = True
    weights[ignored], targets[ignored] = 0.0, -100
    dtype = jnp.dtype(shape.dtype)
    return jnp.asarray(hidden, dtype), jnp.asarray(weight, dtype), jnp.asarray(targets), jnp.asarray(weights)
