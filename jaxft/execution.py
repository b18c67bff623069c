"""`ExecutionConfig`: how a step runs, kept apart from what the model computes.

The model holds parameters and math; everything that changes speed or memory but not the numbers
(up to float rounding) lives here and is handed to the forward pass and the step builder:

- `attention_implementation`: which attention kernel runs (see `kernels_pallas.attention`): "auto" picks per
  batch on the device (cuDNN for single-document rows, the Pallas flash kernel for packed rows, the XLA
  reference on CPU), or one of "reference" ("xla" is its older spelling), "pallas", "cudnn".
- `remat`: what the backward pass recomputes instead of keeping: "none" keeps every residual, "full" keeps
  only layer inputs, "dots" keeps matmul outputs, "offload" moves layer inputs to pinned host memory.
- `layer_loop`: "scan" runs one layer body over stacked weights; "unroll" one program region per layer over
  per-layer weight buffers (no weight-slice copies, longer compile); "auto" unrolls only without remat (the
  host offload was measured to be kept only by the scan).
- `ce_chunk_size` / `ce_implementation`: the linear cross-entropy's token chunk (None = its default) and kernel.
- `compiler_options`: XLA options for the step's program only (never process-wide flags).

Frozen and validated once; every error names the field, which is also the flat `jaxft-train` key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxft.config import ConfigError

ATTENTION_IMPLEMENTATIONS = ("auto", "reference", "xla", "pallas", "cudnn")
REMAT_POLICIES = ("none", "full", "dots", "offload")
LAYER_LOOPS = ("auto", "scan", "unroll")
CE_IMPLEMENTATIONS = ("xla", "reference")


class ExecutionConfigError(ConfigError):
    """A bad execution setting; `field` is the offending ExecutionConfig field (= the flat config key)."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"key {field!r}: {problem}")


def _choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ExecutionConfigError(field, f"value {value!r} is not one of {', '.join(map(repr, choices))}")


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    attention_implementation: str = "auto"
    remat: str = "none"
    layer_loop: str = "auto"
    ce_chunk_size: int | None = None
    ce_implementation: str = "xla"
    compiler_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        _choice("attention_implementation", self.attention_implementation, ATTENTION_IMPLEMENTATIONS)
        _choice("remat", self.remat, REMAT_POLICIES)
        _choice("layer_loop", self.layer_loop, LAYER_LOOPS)
        _choice("ce_implementation", self.ce_implementation, CE_IMPLEMENTATIONS)
        chunk = self.ce_chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ExecutionConfigError("ce_chunk_size", f"value {chunk!r} must be an integer >= 1 (or null for the "
                                                        "kernel's default)")
        if not isinstance(self.compiler_options, Mapping) or not all(isinstance(k, str)
                                                                     for k in self.compiler_options):
            raise ExecutionConfigError("compiler_options", f"value {self.compiler_options!r} must be a mapping of "
                                                           "XLA option name to value")
        # Frozen all the way down: the config is hashed into compiled-step caches.
        object.__setattr__(self, "compiler_options", dict(self.compiler_options))

    @property
    def attention(self) -> str:
        """The attention implementation as `kernels_pallas.attention` names it ("xla" is the reference)."""
        return "reference" if self.attention_implementation == "xla" else self.attention_implementation

    @property
    def resolved_layer_loop(self) -> str:
        """"auto" unrolls only without remat: the host offload and recompute policies are tuned for the scan."""
        if self.layer_loop != "auto":
            return self.layer_loop
        return "unroll" if self.remat == "none" else "scan"

    def replace(self, **changes) -> "ExecutionConfig":
        return dataclasses.replace(self, **changes)

    def __hash__(self) -> int:
        return hash((self.attention_implementation, self.remat, self.layer_loop, self.ce_chunk_size,
                     self.ce_implementation, tuple(sorted(self.compiler_options.items()))))
