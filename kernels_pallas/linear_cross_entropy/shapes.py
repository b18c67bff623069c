"""Linear cross-entropy problem shapes shared by the benchmark (bench.py) and the tests.

``SHAPES`` are the GPU benchmark heads (Llama 3 / Qwen3 / Gemma 2 vocabularies, 16k tokens);
``SMOKE_SHAPE`` is a CPU-sized run of the benchmark; ``TEST_SHAPES`` are the CPU test problems every
implementation is compared on (a chunk remainder, a soft-cap, bf16); ``GPU_TEST_SHAPES`` the device's.
"""

from __future__ import annotations

import dataclasses


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
