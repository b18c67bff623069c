"""GGUF (llama.cpp) names for the dense families: tensor names and metadata keys, read in both directions.

A GGUF tensor is the transformers tensor of the same module under llama.cpp's name (`blk.{i}.attn_q` for
`model.layers.{i}.self_attn.q_proj`, `.weight` / `.bias` kept), in the same [out, in] layout, with two value
changes llama.cpp's converter makes and transformers' GGUF loader undoes:

* `permute_qk`: Llama-architecture q/k projections (weights and biases) have each head's rotary halves
  interleaved, because llama.cpp's Llama kernels rotate adjacent pairs where transformers rotates halves;
* `norm_offset`: Gemma stores every RMSNorm weight as w + 1 (the model computes x_hat * (1 + w)).

Mistral has no architecture of its own in llama.cpp: it is written as `llama` (transformers reads it back as
Llama, the same model without a sliding window); its window, when it has one, goes in
`llama.attention.sliding_window`, which llama.cpp ignores and jaxft reads the file back as Mistral by.

Metadata: `CONFIG_KEYS` pairs a transformers config.json key with the GGUF key after `<arch>.`; a family's
`extra_keys` adds its own.
"""

from __future__ import annotations

import dataclasses

_LAYER = "model.layers.{i}."
_BLOCK = "blk.{i}."

# (transformers module, GGUF tensor name), each taking `.weight` and, where the model has one, `.bias`.
_COMMON = (
    ("model.embed_tokens", "token_embd"),
    ("model.norm", "output_norm"),
    ("lm_head", "output"),
    (_LAYER + "input_layernorm", _BLOCK + "attn_norm"),
    (_LAYER + "self_attn.q_proj", _BLOCK + "attn_q"),
    (_LAYER + "self_attn.k_proj", _BLOCK + "attn_k"),
    (_LAYER + "self_attn.v_proj", _BLOCK + "attn_v"),
    (_LAYER + "self_attn.o_proj", _BLOCK + "attn_output"),
    (_LAYER + "self_attn.q_norm", _BLOCK + "attn_q_norm"),
    (_LAYER + "self_attn.k_norm", _BLOCK + "attn_k_norm"),
    (_LAYER + "mlp.gate_proj", _BLOCK + "ffn_gate"),
    (_LAYER + "mlp.up_proj", _BLOCK + "ffn_up"),
    (_LAYER + "mlp.down_proj", _BLOCK + "ffn_down"),
)
DENSE_MODULES = _COMMON + ((_LAYER + "post_attention_layernorm", _BLOCK + "ffn_norm"),)
# Gemma's sandwich norms: post_attention_layernorm normalises the attention output, pre_feedforward the MLP input.
GEMMA_MODULES = _COMMON + (
    (_LAYER + "post_attention_layernorm", _BLOCK + "post_attention_norm"),
    (_LAYER + "pre_feedforward_layernorm", _BLOCK + "ffn_norm"),
    (_LAYER + "post_feedforward_layernorm", _BLOCK + "post_ffw_norm"),
)

# transformers config.json key <-> GGUF key after "<arch>.", for every family here.
CONFIG_KEYS = (
    ("max_position_embeddings", "context_length"),
    ("hidden_size", "embedding_length"),
    ("num_hidden_layers", "block_count"),
    ("intermediate_size", "feed_forward_length"),
    ("num_attention_heads", "attention.head_count"),
    ("num_key_value_heads", "attention.head_count_kv"),
    ("head_dim", "attention.key_length"),
    ("head_dim", "attention.value_length"),
    ("rms_norm_eps", "attention.layer_norm_rms_epsilon"),
    ("vocab_size", "vocab_size"),
)
GEMMA_KEYS = (
    ("sliding_window", "attention.sliding_window"),
    ("attn_logit_softcapping", "attn_logit_softcapping"),
    ("final_logit_softcapping", "final_logit_softcapping"),
)


@dataclasses.dataclass(frozen=True)
class GgufFamily:
    """How one transformers `model_type` is written as GGUF."""

    arch: str  # general.architecture
    modules: tuple[tuple[str, str], ...]
    permute_qk: bool = False
    norm_offset: float = 0.0
    extra_keys: tuple[tuple[str, str], ...] = ()
    # a metadata key (after `<arch>.`) whose presence tells this family from another of the same arch
    marker: str | None = None
    rope_dimension_is_head_dim: bool = False  # llama: `rope.dimension_count` is what transformers reads as head_dim


FAMILIES: dict[str, GgufFamily] = {
    "llama": GgufFamily("llama", DENSE_MODULES, permute_qk=True, rope_dimension_is_head_dim=True),
    "mistral": GgufFamily("llama", DENSE_MODULES, permute_qk=True, extra_keys=(("sliding_window",
                                                                              "attention.sliding_window"),),
                          marker="attention.sliding_window", rope_dimension_is_head_dim=True),
    "qwen2": GgufFamily("qwen2", DENSE_MODULES),
    "qwen3": GgufFamily("qwen3", DENSE_MODULES),
    "gemma2": GgufFamily("gemma2", GEMMA_MODULES, norm_offset=1.0, extra_keys=GEMMA_KEYS),
    "gemma3_text": GgufFamily("gemma3", GEMMA_MODULES, norm_offset=1.0, extra_keys=GEMMA_KEYS),
}


def model_type_of(arch: str, keys) -> str | None:
    """The transformers model_type of a file of llama.cpp architecture `arch` with metadata `keys`, None if no
    family here writes it."""
    for model_type, fam in FAMILIES.items():
        if fam.arch == arch and fam.marker is not None and f"{arch}.{fam.marker}" in keys:
            return model_type
    for model_type, fam in FAMILIES.items():
        if fam.arch == arch and fam.marker is None:
            return model_type
    return None
