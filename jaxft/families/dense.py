"""Llama 2/3.x, Mistral, Qwen2/2.5 and Qwen3 dense: plain pre-norm blocks, SwiGLU, Llama-style RMSNorm.

They share one weight table (`bridge.mappings.dense`) and one block; they differ in config.json keys:
- Llama: `attention_bias` (q/k/v/o), `mlp_bias`.
- Mistral: one `sliding_window` (or null) for every layer.
- Qwen2: q/k/v always biased, o never (no key says so); windows from `layer_types` or `use_sliding_window` +
  `max_window_layers` (layers >= it slide).
- Qwen3: per-head q/k RMSNorm; `attention_bias`; windows as Qwen2.
"""

from __future__ import annotations

from typing import Any, Mapping

from bridge.mappings import dense as dense_table
from jaxft.families.family import BlockParts, Family
from jaxft.rope_config import RopeConfig

PARTS = BlockParts()


def _windows(model_type: str, hf: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    if model_type == "mistral":
        return (int(window) if window else None,) * num_layers
    if model_type in ("qwen2", "qwen3"):
        types = hf.get("layer_types")
        if types is None:
            use = hf.get("use_sliding_window", False) and window
            start = hf.get("max_window_layers", num_layers)
            types = ["sliding_attention" if use and i >= start else "full_attention" for i in range(num_layers)]
        return tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    return (None,) * num_layers


def _from_hf(model_type: str):
    def config_from_hf(hf: Mapping[str, Any], common: dict[str, Any]) -> dict[str, Any]:
        bias = bool(hf.get("attention_bias", False))
        return dict(
            rope=RopeConfig.from_hf(hf),
            qkv_bias=True if model_type == "qwen2" else bias,
            o_bias=False if model_type == "qwen2" else bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            layer_windows=_windows(model_type, hf, common["num_layers"]),
        )

    return config_from_hf


def _to_hf(cfg, out: dict[str, Any]) -> None:
    if cfg.model_type in ("llama", "qwen3"):
        out["attention_bias"] = cfg.qkv_bias
    if cfg.model_type == "llama":
        out["mlp_bias"] = cfg.mlp_bias
    windows = {w for w in cfg.layer_windows if w is not None}
    if cfg.model_type == "mistral":
        out["sliding_window"] = windows.pop() if windows else None
    elif cfg.model_type in ("qwen2", "qwen3"):
        out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in cfg.layer_windows]
        out["use_sliding_window"] = bool(windows)
        if windows:
            out["sliding_window"] = windows.pop()


def _family(model_type: str, architecture: str):
    return Family(model_type, architecture, dense_table.TABLE, PARTS, _from_hf(model_type), _to_hf)


FAMILIES = tuple(_family(t, a) for t, a in (("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"),
                                              ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")))
HINTS: dict[str, str] = {}
