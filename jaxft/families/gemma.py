"""Gemma 2 and Gemma 3 text (`model_type` "gemma2" / "gemma3_text").

Block: sandwich norms (four per layer), RMSNorm x_hat * (1 + w) in fp32, GeGLU with tanh-approximated gelu,
embeddings times sqrt(hidden_size) (the factor rounded to the activation dtype), tied LM head by default.
Attention scale `query_pre_attn_scalar`**-0.5. Layers alternate sliding and full attention (`layer_types`;
by default Gemma 2 slides on even layers, Gemma 3 on all but every `sliding_window_pattern`-th).
- Gemma 2: attention logit softcap `attn_logit_softcapping` (50) and final logit softcap
  `final_logit_softcapping` (30); one RoPE for all layers.
- Gemma 3: per-head q/k norm (offset form); no attention softcap (transformers' Gemma3 attention does not
  apply one, so a non-null value is refused rather than ignored); sliding layers use the local RoPE
  (`rope_local_base_freq`, 10k, unscaled), full layers the global one (`rope_theta` 1M with `rope_scaling`).
  config.json v5 nests both under `rope_parameters` {"full_attention": ..., "sliding_attention": ...}.
"""

from __future__ import annotations

from typing import Any, Mapping

from bridge.mappings import gemma as gemma_table
from jaxft.errors import ConfigError
from jaxft.families.family import BlockParts, Family
from jaxft.rope_config import RopeConfig

PARTS = BlockParts(norm_offset=True, sandwich_norms=True, embed_scale=True)
_SLIDING, _FULL = "sliding_attention", "full_attention"


def _layer_types(model_type: str, hf: Mapping[str, Any], num_layers: int) -> list[str]:
    types = hf.get("layer_types")
    if types is None:
        pattern = 2 if model_type == "gemma2" else int(hf.get("sliding_window_pattern", 6))
        types = [_SLIDING if (i + 1) % pattern else _FULL for i in range(num_layers)]
    bad = sorted(set(types) - {_SLIDING, _FULL})
    if bad:
        raise ConfigError(f"layer_types has {bad}; Gemma layers are {_SLIDING!r} or {_FULL!r}")
    return list(types)


def _gemma3_ropes(hf: Mapping[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    params = hf.get("rope_parameters") or {}
    if _FULL in params or _SLIDING in params:  # transformers 5: one dict per layer type
        full, sliding = dict(params.get(_FULL) or {}), dict(params.get(_SLIDING) or {})
    else:  # transformers 4: rope_theta + rope_scaling for global layers, rope_local_base_freq for local ones
        full = {**(hf.get("rope_scaling") or {}), **params}
        sliding = {}
        full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
        sliding.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))
    full.setdefault("rope_theta", 1_000_000.0)
    sliding.setdefault("rope_theta", 10_000.0)
    return RopeConfig.from_hf({"rope_parameters": full}), RopeConfig.from_hf({"rope_parameters": sliding})


def _from_hf(model_type: str):
    def config_from_hf(hf: Mapping[str, Any], common: dict[str, Any]) -> dict[str, Any]:
        if hf.get("use_bidirectional_attention"):
            raise ConfigError("use_bidirectional_attention=true is not supported (jaxft trains causal LMs); "
                              "set it to false in config.json")
        types = _layer_types(model_type, hf, common["num_layers"])
        window = hf.get("sliding_window", 4096)
        windows = tuple(int(window) if t == _SLIDING and window else None for t in types)
        bias = bool(hf.get("attention_bias", False))
        kw: dict[str, Any] = dict(
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            qkv_bias=bias, o_bias=bias, mlp_bias=False,
            layer_windows=windows,
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),  # int in transformers: kept as given
        )
        if model_type == "gemma2":
            kw.update(rope=RopeConfig.from_hf(hf), qk_norm=False,
                      attn_logit_softcap=_cap(hf, "attn_logit_softcapping", 50.0),
                      final_logit_softcap=_cap(hf, "final_logit_softcapping", 30.0))
        else:
            if hf.get("attn_logit_softcapping") is not None:
                raise ConfigError(
                    f"attn_logit_softcapping={hf['attn_logit_softcapping']} is not applied by transformers' "
                    "Gemma3 attention; set it to null in config.json (Gemma 3 has no attention softcap)")
            rope, local = _gemma3_ropes(hf)
            kw.update(rope=rope, rope_local=local, qk_norm=True,
                      layer_ropes=tuple("local" if t == _SLIDING else "global" for t in types),
                      final_logit_softcap=_cap(hf, "final_logit_softcapping", None))
        return kw

    return config_from_hf


def _cap(hf: Mapping[str, Any], key: str, default: float | None) -> float | None:
    value = hf.get(key, default)
    return None if value is None else float(value)


def _to_hf(cfg, out: dict[str, Any]) -> None:
    out.pop("hidden_act", None)
    windows = {w for w in cfg.layer_windows if w is not None}
    out.update(
        hidden_activation=cfg.hidden_act, attention_bias=cfg.qkv_bias,
        query_pre_attn_scalar=cfg.query_pre_attn_scalar, final_logit_softcapping=cfg.final_logit_softcap,
        layer_types=[_SLIDING if w else _FULL for w in cfg.layer_windows],
    )
    if windows:
        out["sliding_window"] = windows.pop()
    if cfg.model_type == "gemma2":
        out["attn_logit_softcapping"] = cfg.attn_logit_softcap
    else:
        out.pop("rope_local_base_freq", None)
        out["rope_parameters"] = {_FULL: cfg.rope.to_hf(), _SLIDING: cfg.rope_local.to_hf()}


def _family(model_type: str, architecture: str):
    return Family(model_type, architecture, gemma_table.TABLE, PARTS, _from_hf(model_type), _to_hf)


FAMILIES = (_family("gemma2", "Gemma2ForCausalLM"), _family("gemma3_text", "Gemma3ForCausalLM"))
HINTS = {
    "gemma3": "model_type='gemma3' is the multimodal Gemma 3 (vision tower + text); jaxft loads text-only "
              "Gemma 3 checkpoints (model_type 'gemma3_text', Gemma3ForCausalLM)",
    "gemma": "model_type='gemma' (Gemma 1) is not supported; supported Gemma models: gemma2, gemma3_text",
}
