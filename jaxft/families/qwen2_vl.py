"""Qwen2-VL and Qwen2.5-VL (`model_type` "qwen2_vl" / "qwen2_5_vl"): a vision tower whose merged patch
embeddings replace the image pad tokens of a Qwen2 decoder with multimodal RoPE.

The decoder block is Qwen2's (q/k/v biased, o not; windows as Qwen2); head_dim is always hidden_size /
num_attention_heads (transformers' Qwen2VLAttention ignores a head_dim key). RoPE is M-RoPE:
`rope_parameters.mrope_section` (v4: `rope_scaling` with type "mrope") splits each head's rotated pairs into
chunks turned by the token's t, h and w positions (`jaxft.models.vision.mrope`). The tower is
`jaxft.models.vision` (`ModelConfig.vision`). config.json: transformers 5 nests the text keys under
`text_config`; older files keep them at the top level. Both are read; `to_hf` writes the nested form. Tensor
names: the checkpoint layout (`visual.*`, `model.layers.*`) or transformers 5's module names
(`model.visual.*`, `model.language_model.*`), see `bridge.mappings.qwen2_vl`.
"""

from __future__ import annotations

from typing import Any, Mapping

from bridge.mappings import qwen2_vl as vl_table
from jaxft.errors import ConfigError
from jaxft.families import dense
from jaxft.families.family import BlockParts, Family
from jaxft.rope_config import RopeConfig
from jaxft.vision_config import VisionConfig

PARTS = BlockParts()
# What ModelConfig.to_hf and the dense mapping write at the top level that belongs in text_config.
_TEXT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "hidden_act",
              "layer_types", "use_sliding_window", "sliding_window")


def text_config(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
        return hf
    return {**hf, **{k: v for k, v in text.items() if k != "model_type"}}


def _rope(text: Mapping[str, Any]) -> tuple[RopeConfig, tuple[int, ...]]:
    params = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    section = params.get("mrope_section")
    if not section:
        raise ConfigError("rope_parameters.mrope_section is missing; Qwen2-VL's M-RoPE needs it (e.g. [16, 24, 24])")
    kind = params.get("rope_type", params.get("type", "default"))
    params = {k: v for k, v in params.items() if k not in ("mrope_section", "type")}
    params["rope_type"] = "default" if kind == "mrope" else kind  # transformers reads "mrope" as default
    params.setdefault("rope_theta", text.get("rope_theta", 1_000_000.0))
    return RopeConfig.from_hf({"rope_parameters": params}), tuple(int(s) for s in section)


def _from_hf(kind: str):
    def config_from_hf(hf: Mapping[str, Any], common: dict[str, Any]) -> dict[str, Any]:
        text = text_config(hf)
        rope, section = _rope(text)
        if rope.rope_type == "dynamic":
            raise ConfigError("rope_type='dynamic' with M-RoPE is not supported; use the default or a static kind")
        return dict(rope=rope, mrope_section=section, qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False,
                    head_dim=common["hidden_size"] // common["num_heads"],
                    layer_windows=dense._windows("qwen2", text, common["num_layers"]),
                    vision=VisionConfig.from_hf(kind, hf))

    return config_from_hf


def _to_hf(cfg, out: dict[str, Any]) -> None:
    dense._to_hf(cfg.replace(model_type="qwen2"), out)
    text = dict(out.get("text_config") or {})
    for key in _TEXT_KEYS:
        if key in out:
            text[key] = out.pop(key)
    out.pop("head_dim", None)
    text.pop("head_dim", None)
    for stale in ("rope_scaling", "rope_theta"):
        text.pop(stale, None)
    text["rope_parameters"] = {**cfg.rope.to_hf(), "mrope_section": list(cfg.mrope_section)}
    text["model_type"] = f"{cfg.model_type}_text"
    v = cfg.vision
    out.update(text_config=text, vision_config=v.to_hf(out.get("vision_config")), image_token_id=v.image_token_id,
               video_token_id=v.video_token_id, vision_start_token_id=v.vision_start_token_id)


def _family(model_type: str, architecture: str):
    return Family(model_type, architecture, vl_table.TABLE, PARTS, _from_hf(model_type), _to_hf,
                  text_config=text_config, layouts=(vl_table.V5_TABLE,), modules=vl_table.V5_TABLE)


FAMILIES = (_family("qwen2_vl", "Qwen2VLForConditionalGeneration"),
            _family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"))
HINTS: dict[str, str] = {}
