"""Name map for GPT-OSS (`GptOssForCausalLM`, model_type "gpt_oss"), bf16/fp32 checkpoints.

Attention, norms, embeddings and head are named as in the dense table (`bridge.mappings.dense`: q/k/v/o with
biases, no q/k norm), plus the per-head sink logits. The MLP of every layer is a biased router and E experts
stored as one fused tensor per projection, in transformers' x @ W orientation ([E, in, out]), which is ours:

    model.layers.{i}.self_attn.sinks                [H]        -> ours attn.sinks      [L, H]
    model.layers.{i}.mlp.router.weight              [E, H]     -> ours router          [L, H, E]   (transposed)
    model.layers.{i}.mlp.router.bias                [E]        -> ours router_bias     [L, E]
    model.layers.{i}.mlp.experts.gate_up_proj       [E, H, 2I] -> ours gate_up_proj    [L, E, H, 2I]
    model.layers.{i}.mlp.experts.gate_up_proj_bias  [E, 2I]    -> ours gate_up_bias    [L, E, 2I]
    model.layers.{i}.mlp.experts.down_proj          [E, I, H]  -> ours down_proj       [L, E, I, H]
    model.layers.{i}.mlp.experts.down_proj_bias     [E, H]     -> ours down_bias       [L, E, H]

gate_up keeps transformers' interleaved columns (even = gate, odd = up); the model de-interleaves after the
grouped matmul. MXFP4 checkpoints store the two expert weights as `<name>_blocks` / `<name>_scales` instead
(`bridge.mxfp4`); the other rows are the same.

Expert LoRA (`LORA_PARAMETERS`) targets `experts.gate_up_proj` and `experts.down_proj`, in that (declaration)
order, as PEFT's `target_parameters` does.
"""

from __future__ import annotations

from bridge.mappings import dense
from bridge.mappings.schema import LoraParamRow, Row, Table, validate_table

_L = "model.layers.{i}."
_MLP = ("layers", "mlp")
EXPERT_WEIGHTS = {  # HF parameter name (per layer) -> our path: the rows MXFP4 checkpoints quantise
    _L + "mlp.experts.gate_up_proj": (*_MLP, "gate_up_proj"),
    _L + "mlp.experts.down_proj": (*_MLP, "down_proj"),
}

TABLE: Table = validate_table(
    tuple(row for row in dense.TABLE if ".mlp." not in row.hf and "_norm." not in row.hf) + (
        Row(_L + "self_attn.sinks", ("layers", "attn", "sinks"), None, True),
        Row(_L + "mlp.router.weight", (*_MLP, "router"), "T", True),
        Row(_L + "mlp.router.bias", (*_MLP, "router_bias"), None, True),
        *(Row(hf, path, None, True) for hf, path in EXPERT_WEIGHTS.items()),
        Row(_L + "mlp.experts.gate_up_proj_bias", (*_MLP, "gate_up_bias"), None, True),
        Row(_L + "mlp.experts.down_proj_bias", (*_MLP, "down_bias"), None, True),
    )
)

LORA_PARAMETERS: tuple[LoraParamRow, ...] = tuple(LoraParamRow(hf, (*_MLP, path[-1].replace("_proj", "_lora")))
                                                  for hf, path in EXPERT_WEIGHTS.items())
