"""Name map for the dense decoder family: llama, mistral, qwen2, qwen3.

All four use the same HF tensor names; they differ only in which rows are
present (Qwen2 has q/k/v biases, Qwen3 has q_norm/k_norm, llama has optional
attention/mlp biases, tied models have no lm_head). Presence is decided by the
model (the ``expected`` paths passed to ``load_weights``), not by this table.
"""

from __future__ import annotations

from bridge.mappings.schema import Row, Table, validate_table

_L = "model.layers.{i}."


def _linear(hf_module: str, path: tuple[str, ...]) -> tuple[Row, ...]:
    # torch Linear weight is [out, in]; our kernel is [in, out]. Bias is [out] in both.
    return (
        Row(_L + hf_module + ".weight", ("layers", *path, "kernel"), "T", True),
        Row(_L + hf_module + ".bias", ("layers", *path, "bias"), None, True),
    )


TABLE: Table = validate_table(
    (
        Row("model.embed_tokens.weight", ("embed", "embedding"), None, False),
        Row("model.norm.weight", ("final_norm", "scale"), None, False),
        Row("lm_head.weight", ("lm_head", "kernel"), "T", False),
        Row(_L + "input_layernorm.weight", ("layers", "input_norm", "scale"), None, True),
        Row(_L + "post_attention_layernorm.weight", ("layers", "post_attn_norm", "scale"), None, True),
        *_linear("self_attn.q_proj", ("attn", "q_proj")),
        *_linear("self_attn.k_proj", ("attn", "k_proj")),
        *_linear("self_attn.v_proj", ("attn", "v_proj")),
        *_linear("self_attn.o_proj", ("attn", "o_proj")),
        Row(_L + "self_attn.q_norm.weight", ("layers", "attn", "q_norm", "scale"), None, True),
        Row(_L + "self_attn.k_norm.weight", ("layers", "attn", "k_norm", "scale"), None, True),
        *_linear("mlp.gate_proj", ("mlp", "gate_proj")),
        *_linear("mlp.up_proj", ("mlp", "up_proj")),
        *_linear("mlp.down_proj", ("mlp", "down_proj")),
    )
)
