"""Qwen3-MoE (`model_type` "qwen3_moe", Qwen3MoeForCausalLM): Qwen3 attention with a sparse MLP in most layers.

Attention is Qwen3's (per-head q/k RMSNorm; `attention_bias` on q/k/v/o); with `use_sliding_window` every
layer slides over `sliding_window` (transformers' Qwen3MoeAttention has no `max_window_layers`). The MLP slot
is `jaxft.models.moe.MoeMLP`: `num_experts` (config.json spells it `num_experts` or, as transformers 5 saves
it, `num_local_experts`) experts of width `moe_intermediate_size`, `num_experts_per_tok` per token,
`norm_topk_prob`.

With `output_router_logits`, training adds `router_aux_loss_coef` (default 0.001, as transformers) times the
router load-balancing loss to the cross-entropy (`ModelConfig.router_aux_loss_coef`; `jaxft.train.step`).

Dense layers among the sparse ones, as transformers' Qwen3MoeDecoderLayer decides: layer i is sparse iff
`i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0`; a dense layer is a
SwiGLU MLP of width `intermediate_size` (`ModelConfig.layer_mlps`, "glu"). Their parameters are a second
layer stack (`jaxft.models.stack.layer_stacks`); weights, LoRA and PEFT names keep HF's layer indices.
"""

from __future__ import annotations

from typing import Any, Mapping

from bridge.mappings import qwen3_moe as moe_table
from jaxft.errors import ConfigError
from jaxft.families.family import BlockParts, Family
from jaxft.rope_config import RopeConfig

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


def _layer_mlps(hf: Mapping[str, Any], num_layers: int, num_experts: int) -> tuple[str, ...]:
    """Each layer's MLP kind, by transformers' rule (Qwen3MoeDecoderLayer.__init__)."""
    only = hf.get("mlp_only_layers") or []
    step = hf.get("decoder_sparse_step", 1)
    if not isinstance(only, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ConfigError(f"mlp_only_layers={only!r} must be a list of layer indices")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ConfigError(f"decoder_sparse_step={step!r} must be a positive integer")
    kinds = tuple("moe" if i not in only and num_experts > 0 and (i + 1) % step == 0 else "glu"
                  for i in range(num_layers))
    if "moe" not in kinds:
        raise ConfigError(f"mlp_only_layers={list(only)} / decoder_sparse_step={step} make every layer dense; that is "
                          "a dense Qwen3 model (model_type 'qwen3'), or make some layers sparse")
    return kinds


def config_from_hf(hf: Mapping[str, Any], common: dict[str, Any]) -> dict[str, Any]:
    num_experts = _num_experts(hf)
    bias = bool(hf.get("attention_bias", False))
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    coef = hf.get("router_aux_loss_coef", 0.001)  # transformers' default
    if hf.get("moe_intermediate_size") is None:
        raise ConfigError("required key 'moe_intermediate_size' is missing for model_type='qwen3_moe'")
    return dict(
        rope=RopeConfig.from_hf(hf), qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True,
        layer_windows=(int(window) if window else None,) * common["num_layers"],
        num_experts=num_experts,
        layer_mlps=_layer_mlps(hf, common["num_layers"], num_experts),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        router_aux_loss_coef=(float(coef) if isinstance(coef, (int, float)) and not isinstance(coef, bool) else coef)
        if hf.get("output_router_logits") else None,
    )


def config_to_hf(cfg, out: dict[str, Any]) -> None:
    windows = {w for w in cfg.layer_windows if w is not None}
    key = next((k for k in _EXPERT_KEYS if k in out), "num_experts")  # the source's spelling
    for k in _EXPERT_KEYS:
        out.pop(k, None)
    out[key] = cfg.num_experts
    out.update(attention_bias=cfg.qkv_bias, use_sliding_window=bool(windows),
               num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_intermediate_size,
               norm_topk_prob=cfg.norm_topk_prob, output_router_logits=cfg.router_aux_loss_coef is not None)
    try:  # the source's keys when they still describe the layers, else the dense layers listed explicitly
        kept = _layer_mlps(out, cfg.num_layers, cfg.num_experts) == cfg.layer_mlps
    except ConfigError:
        kept = False
    if not kept:
        out.update(mlp_only_layers=[i for i, kind in enumerate(cfg.layer_mlps) if kind == "glu"],
                   decoder_sparse_step=1)
    if cfg.router_aux_loss_coef is not None:
        out["router_aux_loss_coef"] = cfg.router_aux_loss_coef
    if windows:
        out["sliding_window"] = windows.pop()


def _family():
    return Family("qwen3_moe", "Qwen3MoeForCausalLM", moe_table.TABLE, PARTS, config_from_hf, config_to_hf,
                  lora_parameters=moe_table.LORA_PARAMETERS)


FAMILIES = (_family(),)
HINTS: dict[str, str] = {}
