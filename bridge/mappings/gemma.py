"""Name map for Gemma 2 and Gemma 3 text (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`).

Four norms per layer. HF's `post_attention_layernorm` normalises the attention OUTPUT (our
`attn_out_norm`), `pre_feedforward_layernorm` the residual before the MLP (our `post_attn_norm`, the slot
Llama's post_attention_layernorm fills) and `post_feedforward_layernorm` the MLP output (`mlp_out_norm`).
Norm weights are stored as offsets (the model computes x_hat * (1 + w)) and kept as they are. Gemma 3 adds
q_norm / k_norm; biases exist only with `attention_bias`; the LM head is usually tied (no lm_head tensor).
"""

from __future__ import annotations

from bridge.mappings.schema import Row, Table, validate_table

_L = "model.layers.{i}."


def _linear(hf_module: str, path: tuple[str, ...]) -> tuple[Row, ...]:
    return (
        Row(_L + hf_module + ".weight", ("layers", *path, "kernel"), "transpose", True),
        Row(_L + hf_module + ".bias", ("layers", *path, "bias"), None, True),
    )


def _norm(hf_module: str, path: tuple[str, ...]) -> Row:
    return Row(_L + hf_module + ".weight", ("layers", *path, "scale"), None, True)


TABLE: Table = validate_table(
    (
        Row("model.embed_tokens.weight", ("embed", "embedding"), None, False),
        Row("model.norm.weight", ("final_norm", "scale"), None, False),
        Row("lm_head.weight", ("lm_head", "kernel"), "transpose", False),
        _norm("input_layernorm", ("input_norm",)),
        _norm("post_attention_layernorm", ("attn_out_norm",)),
        _norm("pre_feedforward_layernorm", ("post_attn_norm",)),
        _norm("post_feedforward_layernorm", ("mlp_out_norm",)),
        *_linear("self_attn.q_proj", ("attn", "q_proj")),
        *_linear("self_attn.k_proj", ("attn", "k_proj")),
        *_linear("self_attn.v_proj", ("attn", "v_proj")),
        *_linear("self_attn.o_proj", ("attn", "o_proj")),
        _norm("self_attn.q_norm", ("attn", "q_norm")),
        _norm("self_attn.k_norm", ("attn", "k_norm")),
        Row(_L + "mlp.gate_proj.weight", ("layers", "mlp", "gate_proj", "kernel"), "transpose", True),
        Row(_L + "mlp.up_proj.weight", ("layers", "mlp", "up_proj", "kernel"), "transpose", True),
        Row(_L + "mlp.down_proj.weight", ("layers", "mlp", "down_proj", "kernel"), "transpose", True),
    )
)
