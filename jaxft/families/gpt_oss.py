"""GPT-OSS (`model_type` "gpt_oss", GptOssForCausalLM): sinks, alternating windows, yarn RoPE, a biased MoE.

Block: plain pre-norm (RMSNorm with the product in fp32: identical to the Llama form in fp32; in bf16 jaxft
rounds x_hat to the dtype before the product, transformers after it); attention with q/k/v/o biases
(`attention_bias`, default true), one learned sink logit per head (`attention_sinks`), scale head_dim^-0.5,
`layer_types` alternating sliding (`sliding_window`, 128) and full attention, layer 0 sliding; RoPE yarn
(transformers' default when config.json has none: factor 32, beta 32/1, truncate false, original 4096,
theta 150000). The MLP slot is `jaxft.models.gpt_oss_moe.GptOssMoeMLP`: `num_local_experts` experts of width
`intermediate_size`, `num_experts_per_tok` per token, clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`).

MXFP4 checkpoints (`quantization_config.quant_method` "mxfp4") are decoded on import (`bridge.mxfp4`).
With `output_router_logits`, training adds `router_aux_loss_coef` times the load-balancing loss.
"""

from __future__ import annotations

from typing import Any, Mapping

from bridge.mappings import gpt_oss as gpt_oss_table
from jaxft.errors import ConfigError
from jaxft.families.family import BlockParts, Family
from jaxft.rope_config import RopeConfig

PARTS = BlockParts(mlp="gpt_oss_moe")
_SLIDING, _FULL = "sliding_attention", "full_attention"
# transformers' GptOssConfig defaults for keys a config.json may leave out.
_DEFAULT_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                     original_max_position_embeddings=4096)
_DEFAULT_THETA = 150000.0


def _rope(hf: Mapping[str, Any]) -> RopeConfig:
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if not {k: v for k, v in params.items() if k != "rope_theta"}:
        params = {**_DEFAULT_ROPE, **params}
    params.setdefault("rope_theta", hf.get("rope_theta", _DEFAULT_THETA))
    return RopeConfig.from_hf({"rope_parameters": params})


def _windows(hf: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    types = hf.get("layer_types") or [_SLIDING if (i + 1) % 2 else _FULL for i in range(num_layers)]
    bad = sorted(set(types) - {_SLIDING, _FULL})
    if bad:
        raise ConfigError(f"layer_types has {bad}; GPT-OSS layers are {_SLIDING!r} or {_FULL!r}")
    window = hf.get("sliding_window", 128)
    return tuple(int(window) if t == _SLIDING and window else None for t in types)


def config_from_hf(hf: Mapping[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    if experts is None:
        raise ConfigError("required key 'num_local_experts' is missing for model_type='gpt_oss'")
    bias = bool(hf.get("attention_bias", True))
    coef = hf.get("router_aux_loss_coef", 0.001)
    head_dim = hf.get("head_dim", 64)  # transformers' default; null means hidden_size // num_attention_heads
    return dict(
        rope=_rope(hf), qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False, attention_sinks=True,
        head_dim=int(head_dim) if head_dim else common["hidden_size"] // common["num_heads"],
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 131072)),
        layer_windows=_windows(hf, common["num_layers"]),
        num_experts=int(experts), num_experts_per_tok=int(hf.get("num_experts_per_tok", 4)),
        moe_intermediate_size=common["intermediate_size"],
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)), swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        router_aux_loss_coef=(float(coef) if isinstance(coef, (int, float)) and not isinstance(coef, bool) else coef)
        if hf.get("output_router_logits") else None,
    )


def config_to_hf(cfg, out: dict[str, Any]) -> None:
    windows = {w for w in cfg.layer_windows if w is not None}
    out.pop("num_experts", None)
    out.update(attention_bias=cfg.qkv_bias, num_local_experts=cfg.num_experts,
               num_experts_per_tok=cfg.num_experts_per_tok, swiglu_limit=cfg.swiglu_limit,
               swiglu_alpha=cfg.swiglu_alpha, output_router_logits=cfg.router_aux_loss_coef is not None,
               layer_types=[_SLIDING if w else _FULL for w in cfg.layer_windows])
    if cfg.router_aux_loss_coef is not None:
        out["router_aux_loss_coef"] = cfg.router_aux_loss_coef
    if windows:
        out["sliding_window"] = windows.pop()


def _family():
    return Family("gpt_oss", "GptOssForCausalLM", gpt_oss_table.TABLE, PARTS, config_from_hf, config_to_hf,
                  lora_parameters=gpt_oss_table.LORA_PARAMETERS)


FAMILIES = (_family(),)
HINTS: dict[str, str] = {}
