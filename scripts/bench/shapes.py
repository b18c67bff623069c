"""The model shapes of the training benchmark: Hugging Face config dicts of the real models (Llama 3, Qwen3, Gemma 2
and 3, GPT-OSS, Qwen3-MoE, Qwen2.5-VL) and of tiny ones of the same families for the CPU; the weights are random,
made from these on the device (models.py). Re-exported by workloads."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Mapping

_LLAMA_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "initializer_range": 0.02,
    "use_cache": False,
    # Our generated tokenizer's special ids (real Llama uses 128000/128001; irrelevant here).
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
}


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": factor,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    }


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A named HF config dict (transformers 5 keys: ``rope_parameters``, not ``rope_scaling``).

    A vision-language shape nests its language model's keys in ``text_config`` beside ``vision_config``
    (as transformers 5 saves Qwen2.5-VL) and carries the image processor's ``preprocessor_config.json``
    (``processor_config``), written into the model directory beside the weights.
    """

    name: str
    hf_config: Mapping[str, Any]
    processor_config: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        need = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings")
        missing = [k for k in need if not self.has(k)]
        if missing:
            raise ValueError(f"ModelShape {self.name!r}: hf_config lacks keys {missing}")
        if self.get("num_attention_heads") % self.get("num_key_value_heads"):
            raise ValueError(f"ModelShape {self.name!r}: num_attention_heads must be a multiple "
                             "of num_key_value_heads")
        if self.is_vlm != (self.processor_config is not None):
            raise ValueError(f"ModelShape {self.name!r}: a vision_config needs a processor_config and "
                             "only a vision-language shape takes one")

    @property
    def is_vlm(self) -> bool:
        return "vision_config" in self.hf_config

    def has(self, key: str) -> bool:
        return key in self.hf_config or key in self.hf_config.get("text_config", {})

    def get(self, key: str) -> Any:
        """A config value: top level first, then the language model's ``text_config``; ``head_dim``
        defaults to hidden_size / num_attention_heads as in transformers (Qwen2.5-VL omits it)."""
        if key in self.hf_config:
            return self.hf_config[key]
        text = self.hf_config.get("text_config", {})
        if key in text:
            return text[key]
        if key == "head_dim":
            return self.get("hidden_size") // self.get("num_attention_heads")
        raise KeyError(f"ModelShape {self.name!r}: no config key {key!r}")

    def config_dict(self) -> dict[str, Any]:
        """A fresh, JSON-serialisable deep copy (transformers' config classes edit nested dicts)."""
        return copy.deepcopy(dict(self.hf_config))


_QWEN3_COMMON = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
    "tie_word_embeddings": False, "attention_bias": False, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "use_sliding_window": False, "sliding_window": None, "initializer_range": 0.02, "use_cache": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
}

_GEMMA2_COMMON = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True, "attention_bias": False, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "max_position_embeddings": 8192,
    "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "initializer_range": 0.02,
    "use_cache": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
}

_GEMMA3_COMMON = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True, "attention_bias": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "initializer_range": 0.02,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
    "use_cache": False, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}


_GPT_OSS_COMMON = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_act": "silu",
    "tie_word_embeddings": False, "attention_bias": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    "sliding_window": 128, "swiglu_limit": 7.0, "initializer_range": 0.02, "use_cache": False,
    "output_router_logits": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
}


# Qwen3-30B-A3B's config.json (Qwen/Qwen3-30B-A3B; transformers' Qwen3MoeConfig defaults differ: 24 layers,
# rope_theta 1e4, norm_topk_prob false, no head_dim): 48 layers, all sparse (decoder_sparse_step 1, no
# mlp_only_layers), 128 experts of width 768, top-8 renormalised, 32 query / 4 KV heads of 128 (not hidden / heads).
_QWEN3_MOE_COMMON = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
    "tie_word_embeddings": False, "attention_bias": False, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "use_sliding_window": False, "sliding_window": None, "initializer_range": 0.02, "use_cache": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "output_router_logits": False,
    "router_aux_loss_coef": 0.001, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
}

# Qwen2.5-VL-7B-Instruct's special ids (config.json); the synthetic text never draws them (text_vocab_below).
_QWEN2_5_VL_IDS = {"vision_start_token_id": 151652, "vision_end_token_id": 151653, "image_token_id": 151655,
                   "video_token_id": 151656}
# Its preprocessor_config.json (Qwen2VLImageProcessor: 14-px patches, 2x2 merge, 2 frames per temporal patch).
_QWEN2_5_VL_PROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
}


def _qwen2_5_vl(text: dict[str, Any], vision: dict[str, Any], ids: dict[str, int]) -> dict[str, Any]:
    """A Qwen2.5-VL config as transformers 5 saves it: the language model's keys in text_config (M-RoPE
    sections in rope_parameters), the tower's in vision_config (SwiGLU blocks, windows of window_size pixels,
    full attention in fullatt_block_indexes, 2x2 merger to out_hidden_size = the text hidden size)."""
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "tie_word_embeddings": False, "use_cache": False, **ids,
        "text_config": {"model_type": "qwen2_5_vl_text", "hidden_act": "silu", "rms_norm_eps": 1e-6,
                        "use_sliding_window": False, "sliding_window": None, "initializer_range": 0.02,
                        "attention_dropout": 0.0, "use_cache": False, "bos_token_id": 1, "eos_token_id": 2,
                        "pad_token_id": 3, **text},
        "vision_config": {"model_type": "qwen2_5_vl_vision", "hidden_act": "silu", "in_channels": 3,
                          "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "tokens_per_second": 2, "window_size": 112, "initializer_range": 0.02,
                          "out_hidden_size": text["hidden_size"], **vision},
    }


def _alternating_layer_types(n: int) -> list[str]:
    """GPT-OSS: sliding-window (128) and full attention alternate, layer 0 sliding."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def _gemma3_layer_types(n: int) -> list[str]:
    """Gemma 3's 5:1 pattern: five sliding-window layers, then one global layer."""
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]


SHAPES: dict[str, ModelShape] = {
    "llama-3.2-1b": ModelShape("llama-3.2-1b", {
        **_LLAMA_COMMON, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 128256, "tie_word_embeddings": True, "rope_parameters": _llama3_rope(32.0)}),
    # Llama-3.2-3B: the second size of the full fine-tuning rows.
    "llama-3.2-3b": ModelShape("llama-3.2-3b", {
        **_LLAMA_COMMON, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
        "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "tie_word_embeddings": True, "rope_parameters": _llama3_rope(32.0)}),
    "llama-3.1-8b": ModelShape("llama-3.1-8b", {
        **_LLAMA_COMMON, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "tie_word_embeddings": False, "rope_parameters": _llama3_rope(8.0)}),
    # Llama-3.1-70B: issue #15's FSDP run over 8 GPUs and the memory table's 70B.
    "llama-3.1-70b": ModelShape("llama-3.1-70b", {
        **_LLAMA_COMMON, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "tie_word_embeddings": False, "rope_parameters": _llama3_rope(8.0)}),
    "qwen3-8b": ModelShape("qwen3-8b", {
        **_QWEN3_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "max_window_layers": 36}),
    # Gemma-2-9B: sliding window 4096 on every other layer, logit softcaps 50 (attention) / 30 (final).
    "gemma-2-9b": ModelShape("gemma-2-9b", {
        **_GEMMA2_COMMON, "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256,
        "sliding_window": 4096, "vocab_size": 256000}),
    # Gemma-3-12B (text): 5 sliding (window 1024, RoPE base 10k) : 1 global (base 1M, linear x8), qk-norm, no softcaps.
    "gemma-3-12b": ModelShape("gemma-3-12b", {
        **_GEMMA3_COMMON, "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "query_pre_attn_scalar": 256,
        "sliding_window": 1024, "layer_types": _gemma3_layer_types(48), "vocab_size": 262208}),
    # GPT-OSS-20B: 24 layers of 32 experts (top-4, width 2880), 64 query heads x 64, 8 KV heads, sinks, yarn RoPE.
    "gpt-oss-20b": ModelShape("gpt-oss-20b", {
        **_GPT_OSS_COMMON, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
        "num_experts_per_tok": 4, "layer_types": _alternating_layer_types(24), "vocab_size": 201088}),
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", {
        **_QWEN3_MOE_COMMON, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "max_position_embeddings": 40960,
        "max_window_layers": 48, "vocab_size": 151936}),
    # Qwen2.5-VL-7B-Instruct: Qwen2-7B's decoder (28 layers, 28 / 4 heads of 128, M-RoPE 16/24/24) and a 32-block
    # 1280-wide tower (16 heads, SwiGLU 3420, windows of 112 px, full attention in blocks 7, 15, 23, 31).
    "qwen2.5-vl-7b": ModelShape("qwen2.5-vl-7b", _qwen2_5_vl(
        {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
         "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 128000,
         "max_window_layers": 28,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}},
        {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
         "fullatt_block_indexes": [7, 15, 23, 31]}, _QWEN2_5_VL_IDS), _QWEN2_5_VL_PROCESSOR),
    # Tiny shapes for the CPU smoke test (--tiny): same families, same code paths.
    "tiny-qwen3-moe": ModelShape("tiny-qwen3-moe", {
        **_QWEN3_MOE_COMMON, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 4096, "vocab_size": 512}),
    # Window 56 px = 2 x 2 merged tokens: a 140 px image (5 x 5 merged) has partial windows at its edges.
    "tiny-qwen2.5-vl": ModelShape("tiny-qwen2.5-vl", _qwen2_5_vl(
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096, "max_window_layers": 2,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}},
        {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "window_size": 56,
         "fullatt_block_indexes": [1]},
        {"vision_start_token_id": 508, "vision_end_token_id": 509, "image_token_id": 510, "video_token_id": 511}),
        _QWEN2_5_VL_PROCESSOR),
    "tiny-gpt-oss": ModelShape("tiny-gpt-oss", {
        **_GPT_OSS_COMMON, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "num_local_experts": 4,
        "num_experts_per_tok": 2, "layer_types": _alternating_layer_types(2), "vocab_size": 512}),
    "tiny-gemma3": ModelShape("tiny-gemma3", {
        **_GEMMA3_COMMON, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16,
        "sliding_window": 32, "layer_types": _gemma3_layer_types(6), "vocab_size": 512}),
    "tiny-gemma2": ModelShape("tiny-gemma2", {
        **_GEMMA2_COMMON, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16,
        "sliding_window": 32, "vocab_size": 512}),
    "tiny-llama": ModelShape("tiny-llama", {
        **_LLAMA_COMMON, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 512, "tie_word_embeddings": True, "rope_parameters": _llama3_rope(32.0)}),
    "tiny-qwen3": ModelShape("tiny-qwen3", {
        **_QWEN3_COMMON, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 512, "max_position_embeddings": 4096, "max_window_layers": 2}),
}
