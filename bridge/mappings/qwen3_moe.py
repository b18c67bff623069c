"""Name map for Qwen3-MoE (`Qwen3MoeForCausalLM`, model_type "qwen3_moe").

Attention, norms, embeddings and head are named as in the dense table (`bridge.mappings.dense`, Qwen3 rows:
q/k norm, optional attention biases). The MLP of every layer is a router and E experts, stored per expert as
transformers 5 writes them on disk (its module fuses them into 3-D `experts.gate_up_proj` / `down_proj`
parameters, but `save_pretrained` converts back to these names):

    model.layers.{i}.mlp.gate.weight                    [E, H]  -> ours router     [L, H, E]
    model.layers.{i}.mlp.experts.{e}.gate_proj.weight   [I, H]  -> ours gate_up_proj [L, E, H, 2I], columns :I
    model.layers.{i}.mlp.experts.{e}.up_proj.weight     [I, H]  -> ours gate_up_proj [L, E, H, 2I], columns I:
    model.layers.{i}.mlp.experts.{e}.down_proj.weight   [H, I]  -> ours down_proj    [L, E, I, H]

Every row is transposed ([out, in] -> [in, out]); the fused on-disk layout is not read (see the family). Gate and
up are the two halves of one weight (`Row.part`), as in transformers' fused `gate_up_proj` (gate rows first): the
block runs one grouped matmul of width 2I for both instead of two of width I.

Dense layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step`) are the `dense_layers` stack:
the dense table's per-layer rows again (attention, norms and `mlp.{gate,up,down}_proj`), under that stack; the
caller's layer map (`jaxft.models.stack.layer_stacks`) says which HF layer each row of either stack is.

Expert LoRA (`LORA_PARAMETERS`) targets the fused module parameters, as PEFT's `target_parameters` does:
`experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `experts.down_proj` [E, H, I], declared in
that order by transformers' Qwen3MoeExperts.
"""

from __future__ import annotations

from bridge.mappings import dense
from bridge.mappings.schema import LoraParamRow, Row, Table, validate_table

_L = "model.layers.{i}."
_EXPERT = _L + "mlp.experts.{e}."

TABLE: Table = validate_table(
    tuple(row for row in dense.TABLE if ".mlp." not in row.hf) + (
        Row(_L + "mlp.gate.weight", ("layers", "mlp", "router"), "T", True),
        Row(_EXPERT + "gate_proj.weight", ("layers", "mlp", "gate_up_proj"), "T", True, part=(0, 2)),
        Row(_EXPERT + "up_proj.weight", ("layers", "mlp", "gate_up_proj"), "T", True, part=(1, 2)),
        Row(_EXPERT + "down_proj.weight", ("layers", "mlp", "down_proj"), "T", True),
    ) + tuple(Row(row.hf, ("dense_layers", *row.path[1:]), row.transform, True) for row in dense.TABLE
              # Qwen3MoeMLP (the dense layers' MLP) has no biases, whatever mlp_bias says.
              if row.stacked and not (".mlp." in row.hf and row.hf.endswith(".bias")))
)

LORA_PARAMETERS: tuple[LoraParamRow, ...] = (
    LoraParamRow(_L + "mlp.experts.gate_up_proj", ("layers", "mlp", "gate_up_lora")),
    LoraParamRow(_L + "mlp.experts.down_proj", ("layers", "mlp", "down_lora")),
)
