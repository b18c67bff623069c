"""Frozen, typed model configuration with lossless conversion from and to Hugging Face `config.json`.

One `ModelConfig` covers the dense decoder family jaxft implements (Llama 2/3.x, Mistral, Qwen2/2.5,
Qwen3 dense). Family quirks are flags, not subclasses, so one decoder implementation serves all of them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class ConfigError(ValueError):
    """A configuration value is missing, malformed or unsupported. The message names the key and the fix."""


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


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a dense decoder. `layer_windows[i]` is the sliding window of layer i (None = full)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"
    # The source config.json, kept so that `to_hf` round-trips keys jaxft does not model (token ids, ...).
    hf_json: str = dataclasses.field(default="{}", compare=False, repr=False)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type={self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{key} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.hidden_act not in ("silu", "swish"):
            raise ConfigError(f"hidden_act={self.hidden_act!r} is not supported by jaxft's decoder; use 'silu'")
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (None,) * self.num_layers)
        if len(self.layer_windows) != self.num_layers:
            raise ConfigError(
                f"layer_types/layer_windows has {len(self.layer_windows)} entries but num_hidden_layers is "
                f"{self.num_layers}"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Builds a config from a transformers `config.json` dict. `source` names the file in errors."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type={model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )

        def need(key):
            if hf.get(key) is None:
                raise ConfigError(f"{source}: required key {key!r} is missing for model_type={model_type!r}")
            return hf[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        num_layers = int(need("num_hidden_layers"))
        head_dim = hf.get("head_dim") or hidden // heads
        window = hf.get("sliding_window")
        if model_type == "mistral":
            windows = (int(window) if window else None,) * num_layers
        elif model_type in ("qwen2", "qwen3"):
            types = hf.get("layer_types")
            if types is None:
                use = hf.get("use_sliding_window", False) and window
                start = hf.get("max_window_layers", num_layers)
                types = ["sliding_attention" if use and i >= start else "full_attention" for i in range(num_layers)]
            windows = tuple(int(window) if t == "sliding_attention" and window else None for t in types)
        else:
            windows = (None,) * num_layers
        try:
            return cls(
                model_type=model_type,
                vocab_size=int(need("vocab_size")),
                hidden_size=hidden,
                intermediate_size=int(need("intermediate_size")),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                rope=RopeConfig.from_hf(hf),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
                o_bias=False if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
                mlp_bias=bool(hf.get("mlp_bias", False)),
                qk_norm=model_type == "qwen3",
                layer_windows=windows,
                hidden_act=hf.get("hidden_act", "silu"),
                hf_json=json.dumps(dict(hf), sort_keys=True, default=str),
            )
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        out = json.loads(self.hf_json)
        for stale in ("rope_scaling", "rope_theta", "torch_dtype", "dtype", "transformers_version"):
            out.pop(stale, None)
        out.update(
            model_type=self.model_type, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
            rope_parameters=self.rope.to_hf(), tie_word_embeddings=self.tie_word_embeddings,
            hidden_act=self.hidden_act,
        )
        if self.model_type in ("llama", "qwen3"):
            out["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        windows = {w for w in self.layer_windows if w is not None}
        if self.model_type == "mistral":
            out["sliding_window"] = windows.pop() if windows else None
        elif self.model_type in ("qwen2", "qwen3"):
            out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in self.layer_windows]
            out["use_sliding_window"] = bool(windows)
            if windows:
                out["sliding_window"] = windows.pop()
        out.setdefault("architectures", [_ARCHITECTURES[self.model_type]])
        return out

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def num_params(self) -> int:
        """Parameter count of the base model (embeddings included)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * h * i + 2 * h + (2 * d if self.qk_norm else 0)
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + head + h + self.num_layers * per_layer


_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
