"""`QuantConfig`: which frozen linears are stored in 4 bits and how (bitsandbytes' meaning of every field);
`Fp8Config`: which are stored in FP8; and transformers' rule for matching `llm_int8_skip_modules` names."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from jaxft.errors import ConfigError
from jaxft.quant.blockwise import BLOCKSIZES, NESTED_ROUNDINGS
from kernels_pallas.fp8_matmul import IMPLEMENTATIONS as FP8_IMPLEMENTATIONS

__all__ = ["DEFAULT_SKIP", "Fp8Config", "QuantConfig", "QuantConfigError", "is_skipped"]

# Never quantised unless asked: the output head (transformers keeps it too), routers and vision towers.
DEFAULT_SKIP = ("lm_head", "mlp.gate", "router", "vision_tower", "visual", "multi_modal_projector")


class QuantConfigError(ConfigError):
    """A bad 4-bit setting; `field` and `problem` as `jaxft.lora.LoraConfigError` (TrainConfig restates it under
    its own key)."""

    def __init__(self, field: str, problem: str, owner: str = "QuantConfig"):
        self.field, self.problem = field, problem
        super().__init__(f"{owner}.{field}: {problem}")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How frozen linears are stored in 4 bits (bitsandbytes' meaning; BitsAndBytesConfig names in brackets).

    quant_type [bnb_4bit_quant_type]: "nf4" or "fp4".  double_quant [bnb_4bit_use_double_quant]: absmax in
    8 bits.  blocksize: elements per absmax (bitsandbytes' 64).  nested_blocksize: absmax per nested absmax.
    nested_rounding: "cuda" (nearest) or "cpu" (bitsandbytes' CPU lookup table), see `jaxft.quant.blockwise`.
    skip_modules [llm_int8_skip_modules]: HF module names kept in the model dtype, matched as transformers
    does (from the start up to a module boundary, as a regex with that boundary, or as a suffix), layer by layer:
    "model.layers.1.mlp.down_proj" keeps that layer's alone.
    max_rel_error: dynamic 4-bit: each layer of a module whose relative quantisation error
    ||W - Q(W)||_F / ||W||_F exceeds it stays in the model dtype, the others in 4 bits (None: no such check).
    """

    quant_type: str = "nf4"
    double_quant: bool = True
    blocksize: int = 64
    nested_blocksize: int = 256
    nested_rounding: str = "cuda"
    skip_modules: tuple[str, ...] = DEFAULT_SKIP
    max_rel_error: float | None = None

    def __post_init__(self):
        def bad(field, why):
            raise QuantConfigError(field, f"value {getattr(self, field)!r} is invalid; {why}")

        if self.quant_type not in ("nf4", "fp4"):
            bad("quant_type", "use 'nf4' or 'fp4'")
        if not isinstance(self.double_quant, bool):
            bad("double_quant", "must be True or False")
        if self.blocksize not in BLOCKSIZES:
            bad("blocksize", f"use one of {BLOCKSIZES}")
        if not isinstance(self.nested_blocksize, int) or self.nested_blocksize <= 0:
            bad("nested_blocksize", "must be a positive integer (bitsandbytes uses 256)")
        if self.nested_rounding not in NESTED_ROUNDINGS:
            bad("nested_rounding", f"use one of {NESTED_ROUNDINGS}")
        skip = (self.skip_modules,) if isinstance(self.skip_modules, str) else tuple(self.skip_modules or ())
        if not all(isinstance(k, str) and k for k in skip):
            bad("skip_modules", "must be a list of module names, e.g. ['lm_head', 'mlp.down_proj']")
        object.__setattr__(self, "skip_modules", skip)
        if self.max_rel_error is not None and not (isinstance(self.max_rel_error, (int, float))
                                                   and not isinstance(self.max_rel_error, bool)
                                                   and 0 < self.max_rel_error < 1):
            bad("max_rel_error", "must be a number in (0, 1), e.g. 0.12, or None")

    @classmethod
    def from_hf(cls, q: dict) -> "QuantConfig":
        """From config.json's bitsandbytes `quantization_config`."""
        skip = q.get("llm_int8_skip_modules")
        return cls(quant_type=q.get("bnb_4bit_quant_type", "nf4"),
                   double_quant=bool(q.get("bnb_4bit_use_double_quant", False)),
                   skip_modules=tuple(skip) if skip else ())

    def to_hf(self, compute_dtype: str, skipped: Iterable[str]) -> dict:
        """config.json's `quantization_config`, with the modules kept in the model dtype as llm_int8_skip_modules."""
        skipped = sorted(set(skipped))
        return {"_load_in_4bit": True, "_load_in_8bit": False, "bnb_4bit_compute_dtype": compute_dtype,
                "bnb_4bit_quant_storage": "uint8", "bnb_4bit_quant_type": self.quant_type,
                "bnb_4bit_use_double_quant": self.double_quant, "llm_int8_enable_fp32_cpu_offload": False,
                "llm_int8_has_fp16_weight": False, "llm_int8_skip_modules": skipped or None,
                "llm_int8_threshold": 6.0, "load_in_4bit": True, "load_in_8bit": False,
                "quant_method": "bitsandbytes"}


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """Frozen linears and MoE expert stacks stored in FP8 (float8_e4m3fn codes, one float32 scale per output
    channel; see `kernels_pallas.fp8_matmul`): half the bytes of bf16, and on FP8 tensor cores both frozen GEMMs of a
    linear in FP8 (the experts' grouped matmuls run on each layer's weights dequantised to the compute dtype; an FP8
    checkpoint's experts keep their stored block scales).

    skip_modules: HF module names kept in the model dtype, matched as `QuantConfig.skip_modules` ("mlp.experts"
    keeps the MoE experts).
    implementation: the fp8_matmul implementation ("auto": FP8 GEMMs on a GPU of compute capability 8.9+, else
    the weight dequantised to the compute dtype inside each matmul).
    """

    skip_modules: tuple[str, ...] = DEFAULT_SKIP
    implementation: str = "auto"

    def __post_init__(self):
        skip = (self.skip_modules,) if isinstance(self.skip_modules, str) else tuple(self.skip_modules or ())
        if not all(isinstance(k, str) and k for k in skip):
            raise QuantConfigError("skip_modules", f"value {self.skip_modules!r} is invalid; must be a list of "
                                                   "module names, e.g. ['lm_head', 'mlp.down_proj']", "Fp8Config")
        object.__setattr__(self, "skip_modules", skip)
        if self.implementation not in FP8_IMPLEMENTATIONS:
            raise QuantConfigError("implementation", f"value {self.implementation!r} is invalid; use one of "
                                                     f"{FP8_IMPLEMENTATIONS}", "Fp8Config")


def is_skipped(name: str, patterns: Iterable[str]) -> bool:
    """transformers' rule for llm_int8_skip_modules (`should_convert_module`, negated)."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{key}){boundary}", name) or name.endswith(key) for key in patterns)
