"""Qwen3-MoE (`model_type` "qwen3_moe", Qwen3MoeForCausalLM): Qwen3 attention with a sparse MLP in every layer.

Attention is Qwen3's (per-head q/k RMSNorm; `attention_bias` on q/k/v/o); with `use_sliding_window` every
layer slides over `sliding_window` (transformers' Qwen3MoeAttention has no `max_window_layers`). The MLP slot
is `jaxft.models.moe.MoeMLP`: `num_experts` (config.json spells it `num_experts` or, as transformers 5 saves
it, `num_local_experts`) experts of width `moe_intermediate_size`, `num_experts_per_tok` per token,
`norm_topk_prob`.

With `output_router_logits`, training adds `router_aux_loss_coef` (default 0.001, as transformers) times the
router load-balancing loss to the cross-entropy (`ModelConfig.router_aux_loss_coef`; `jaxft.train.step`).

Not modelled yet, and refused when it matters: dense layers among the sparse ones (`mlp_only_layers`,
`decoder_sparse_step` > 1 need a second parameter stack per MLP kind).
"""

from __future__ import annotations

from typing import Any, Mapping

from bridge.mappings import qwen3_moe as moe_table
from jaxft.config import ConfigError, ModelConfig, RopeConfig
from jaxft.models.parts import BlockParts

PARTS = BlockParts(mlp="moe")
_EXPERT_KEYS = ("num_experts", "num_local_experts")


def _num_experts(hf: Mapping[str, Any]) -> int:
    values = {k: hf[k] for k in _EXPERT_KEYS if hf.get(k) is not None}
    if len(set(values.values())) > 1:
        raise ConfigError(f"num_experts={values['num_experts']} and num_local_experts={values['num_local_experts']} "
                          "disagree; keep one of them in config.json")
    if not values:
        raise ConfigError("required key 'num_experts' is missing for model_type='qwen3_moe'")
    return int(next(iter(values.values())))


def _check_all_sparse(hf: Mapping[str, Any], num_layers: int, num_experts: int) -> None:
    only = list(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = [i for i in range(num_layers) if i in only or not (num_experts > 0 and (i + 1) % step == 0)]
    if dense:
        raise ConfigError(
            f"mlp_only_layers={only} / decoder_sparse_step={step} make layers {dense} dense; jaxft's Qwen3-MoE "
            "needs every layer sparse (mlp_only_layers: [], decoder_sparse_step: 1)")


def config_from_hf(hf: Mapping[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    num_experts = _num_experts(hf)
    _check_all_sparse(hf, common["num_layers"], num_experts)
    bias = bool(hf.get("attention_bias", False))
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    coef = hf.get("router_aux_loss_coef", 0.001)  # transformers' default
    if hf.get("moe_intermediate_size") is None:
        raise ConfigError("required key 'moe_intermediate_size' is missing for model_type='qwen3_moe'")
    return dict(
        rope=RopeConfig.from_hf(hf), qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True,
        layer_windows=(int(window) if window else None,) * common["num_layers"],
        num_experts=num_experts,
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        router_aux_loss_coef=(float(coef) if isinstance(coef, (int, float)) and not isinstance(coef, bool) else coef)
        if hf.get("output_router_logits") else None,
    )


def config_to_hf(cfg: ModelConfig, out: dict[str, Any]) -> None:
    windows = {w for w in cfg.layer_windows if w is not None}
    key = next((k for k in _EXPERT_KEYS if k in out), "num_experts")  # the source's spelling
    for k in _EXPERT_KEYS:
        out.pop(k, None)
    out[key] = cfg.num_experts
    out.update(attention_bias=cfg.qkv_bias, use_sliding_window=bool(windows),
               num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_intermediate_size,
               norm_topk_prob=cfg.norm_topk_prob, mlp_only_layers=[], decoder_sparse_step=1,
               output_router_logits=cfg.router_aux_loss_coef is not None)
    if cfg.router_aux_loss_coef is not None:
        out["router_aux_loss_coef"] = cfg.router_aux_loss_coef
    if windows:
        out["sliding_window"] = windows.pop()


def _family():
    from jaxft.models.families import Family  # the registry module imports this one

    return Family("qwen3_moe", "Qwen3MoeForCausalLM", moe_table.TABLE, PARTS, config_from_hf, config_to_hf,
                  lora_parameters=moe_table.LORA_PARAMETERS)


FAMILIES = (_family(),)
HINTS: dict[str, str] = {}
