"""RoPE parameters as transformers reads them from config.json (`rope_parameters`, the legacy `rope_scaling`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxft.errors import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters as transformers computes them (see `jaxft.models.rope`)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"rope_parameters.rope_type={self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )
        if self.rope_type in ("llama3", "yarn") and self.original_max_position_embeddings is None:
            raise ConfigError(
                f"rope_parameters.rope_type={self.rope_type!r} needs 'original_max_position_embeddings'; add it to "
                "rope_parameters (rope_scaling) in config.json"
            )
        if self.rope_type != "default" and not self.factor > 0:
            raise ConfigError(f"rope_parameters.factor must be > 0 for rope_type={self.rope_type!r}, got {self.factor}")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "RopeConfig":
        params = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        params = {**legacy, **params}  # rope_parameters (v5) wins over the legacy rope_scaling (v4)
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        kw: dict[str, Any] = dict(rope_type=rope_type, theta=float(theta))
        for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                    "attention_factor", "mscale", "mscale_all_dim", "partial_rotary_factor"):
            if params.get(key) is not None:
                kw[key] = float(params[key])
        if "partial_rotary_factor" not in kw and hf.get("partial_rotary_factor") is not None:
            kw["partial_rotary_factor"] = float(hf["partial_rotary_factor"])
        if params.get("original_max_position_embeddings") is not None:
            kw["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
        if "truncate" in params:
            kw["truncate"] = bool(params["truncate"])
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.theta}
        if self.rope_type == "default":
            return out
        out["factor"] = self.factor
        if self.rope_type == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                       original_max_position_embeddings=self.original_max_position_embeddings)
        if self.rope_type == "yarn":
            out.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate,
                       original_max_position_embeddings=self.original_max_position_embeddings)
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(self, key) is not None:
                    out[key] = getattr(self, key)
        return out
