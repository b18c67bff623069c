"""Workload definitions shared by every system of the training benchmark.

Everything a worker needs to train "the same thing" lives here and nowhere else:

* the model shapes (Hugging Face config dicts of the real models; weights are random),
* the workloads (shape x batch x sequence length x packing),
* the LoRA and optimizer settings,
* the token data (seeded numpy, identical for every system; checked by a SHA-256),
* the useful-FLOP formula used for MFU.

Useful FLOPs of one optimizer step (the formula printed in every report):

    useful = tokens * (4 * P_frozen + 6 * P_lora) + 12 * L * H_q * D * pairs  [+ vision, below]

* ``P_frozen``: parameters of the frozen matmuls a token runs through (q, k, v, o, gate, up, down of
  every layer plus the lm_head; the embedding lookup is not a matmul). Forward costs 2 FLOPs per
  parameter and token, backward 2 more for the input gradient; the frozen weights get no weight
  gradient. A mixture-of-experts layer counts its router (hidden x experts) and the top-k experts a
  token is routed to (gate_up hidden x 2I, down I x hidden), not all of them: those are the FLOPs
  that run.
* ``P_lora``: LoRA parameters a token runs through (r * (in + out) per adapted linear; expert LoRA,
  PEFT's ``target_parameters``: the top-k experts' factors): forward 2, input gradient 2, weight
  gradient 2. The trainable count (``param_counts(...)["lora"]``, checked against every system's)
  holds every expert's factors.
* vision-language shapes add the vision tower's FORWARD only (its weights are frozen and nothing
  trainable is upstream of it, so no system runs its backward): 2 FLOPs per matmul parameter per
  patch (patch embedding, blocks) and per merged token (the merger), plus 4 * D_v per (query, key)
  pair and head of its bidirectional attention (window blocks: pairs within a window; full blocks:
  within an image). ``tokens`` are text + image tokens (the language model runs on both).
* attention: per layer and head, QK^T and PV cost 2 * D FLOPs per (query, key) pair each in the
  forward (4 * D), the backward twice that, so 12 * D per pair. ``pairs`` counts the causal
  (query, key) pairs that are allowed, diagonal included: T (T + 1) / 2 for a plain row, and the
  sum of n (n + 1) / 2 over the documents of a packed row (cross-document pairs are not useful).
* Not counted: norms, activations, softmax, the loss, recomputation by gradient checkpointing.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import zlib
from typing import Any, Mapping

import numpy as np

# --------------------------------------------------------------------------------------------
# Training settings shared by every system.
# --------------------------------------------------------------------------------------------

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Mixture-of-experts MLPs have no Linear modules: their experts are raw [E, ., .] parameters that LoRA adapts
# through PEFT's target_parameters (jaxft: lora_target_parameters; Unsloth derives the same two from gate/up/down).
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """LoRA on every target linear: y = W x + (alpha / r) * B (A x); dropout off, no bias."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS
    expert_targets: tuple[str, ...] = EXPERT_TARGETS  # on MoE shapes only

    def __post_init__(self) -> None:
        if self.r <= 0 or self.alpha <= 0:
            raise ValueError(f"LoraSettings: r={self.r} and alpha={self.alpha} must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraSettings: dropout={self.dropout} must be in [0, 1)")
        unknown = set(self.targets) - set(LORA_TARGETS)
        if unknown:
            raise ValueError(f"LoraSettings: unknown targets {sorted(unknown)}; known {LORA_TARGETS}")
        unknown = set(self.expert_targets) - set(EXPERT_TARGETS)
        if unknown:
            raise ValueError(f"LoraSettings: unknown expert_targets {sorted(unknown)}; known {EXPERT_TARGETS}")


@dataclasses.dataclass(frozen=True)
class AdamWSettings:
    """AdamW (decoupled weight decay) on the LoRA parameters only, constant learning rate.

    Note optax.adamw defaults to weight_decay=1e-4; torch.optim.AdamW to 1e-2: pass 0.0 explicitly.
    """

    lr: float = 1e-4
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.lr <= 0 or not (0 <= self.b1 < 1 and 0 <= self.b2 < 1) or self.eps <= 0:
            raise ValueError(f"AdamWSettings: invalid {self}")


LORA = LoraSettings()
ADAMW = AdamWSettings()

# --------------------------------------------------------------------------------------------
# Model shapes (HF config dicts; random weights are created from them on the device).
# --------------------------------------------------------------------------------------------

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

# Qwen2.5-VL-7B-Instruct's special ids (config.json); the synthetic text never draws them (TEXT_VOCAB_BELOW).
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
    "llama-3.1-8b": ModelShape("llama-3.1-8b", {
        **_LLAMA_COMMON, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "tie_word_embeddings": False, "rope_parameters": _llama3_rope(8.0)}),
    # Llama-3.1-70B: issue #15's FSDP run over 8 GPUs (scripts/bench_scaling.py) and the memory table's 70B.
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

# --------------------------------------------------------------------------------------------
# Workloads.
# --------------------------------------------------------------------------------------------

PACKED_DOC_SIGMA = 1.0  # lognormal sigma of packed document lengths (mean is set per workload)
PACKED_MIN_DOC = 2      # shortest document: one with a single token has no target


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark row: a model shape trained on ``batch`` rows of ``seq_len`` tokens.

    ``packed``: each row is a concatenation of documents whose lengths are lognormal with mean
    ``mean_doc_len`` (the last one cut to fill the row; no padding), positions restart at 0 per
    document and no attention or loss crosses a document boundary.
    ``image_size``: (vision-language shapes) each row holds one synthetic ``image_size`` x ``image_size``
    image (seeded noise) after a short text prefix, its image tokens and then text to ``seq_len``
    tokens in all (text + image tokens); the image tokens carry no loss.
    """

    name: str
    shape_name: str
    batch: int
    seq_len: int
    packed: bool = False
    mean_doc_len: int = 0
    tiny: bool = False
    image_size: int = 0

    def __post_init__(self) -> None:
        if self.shape_name not in SHAPES:
            raise ValueError(f"Workload {self.name!r}: unknown shape {self.shape_name!r}; "
                             f"known {sorted(SHAPES)}")
        if self.batch < 1 or self.seq_len < 2:
            raise ValueError(f"Workload {self.name!r}: batch={self.batch} must be >= 1 and "
                             f"seq_len={self.seq_len} >= 2")
        if self.packed and not PACKED_MIN_DOC <= self.mean_doc_len <= self.seq_len:
            raise ValueError(f"Workload {self.name!r}: packed needs {PACKED_MIN_DOC} <= "
                             f"mean_doc_len={self.mean_doc_len} <= seq_len={self.seq_len}")
        if (self.image_size > 0) != self.shape.is_vlm or self.image_size < 0:
            raise ValueError(f"Workload {self.name!r}: image_size={self.image_size} must be > 0 exactly when "
                             f"the shape {self.shape_name!r} is a vision-language one")
        if self.image_size and self.packed:
            raise ValueError(f"Workload {self.name!r}: image rows are not packed (one chat per row)")

    @property
    def shape(self) -> ModelShape:
        return SHAPES[self.shape_name]

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len

    @property
    def seed(self) -> int:
        # Stable across processes and Python versions (hash() is salted per process).
        return zlib.crc32(self.name.encode()) & 0x7FFFFFFF

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("1b_2x4096", "llama-3.2-1b", 2, 4096),
    Workload("8b_4096", "llama-3.1-8b", 1, 4096),
    Workload("8b_16384", "llama-3.1-8b", 1, 16384),
    Workload("70b_4096", "llama-3.1-70b", 1, 4096),
    Workload("qwen3_8b_4096", "qwen3-8b", 1, 4096),
    Workload("8b_packed_16384", "llama-3.1-8b", 1, 16384, packed=True, mean_doc_len=300),
    # Issue #10's long rows: one row per step (its table's 32k / 64k, and packed 64k).
    Workload("8b_32768", "llama-3.1-8b", 1, 32768),
    Workload("8b_65536", "llama-3.1-8b", 1, 65536),
    Workload("8b_packed_65536", "llama-3.1-8b", 1, 65536, packed=True, mean_doc_len=300),
    Workload("gemma2_9b_4096", "gemma-2-9b", 1, 4096),
    Workload("gemma2_9b_packed_16384", "gemma-2-9b", 1, 16384, packed=True, mean_doc_len=300),
    Workload("gemma3_12b_4096", "gemma-3-12b", 1, 4096),
    Workload("gemma3_12b_packed_16384", "gemma-3-12b", 1, 16384, packed=True, mean_doc_len=300),
    Workload("gpt_oss_20b_4096", "gpt-oss-20b", 1, 4096),
    Workload("gpt_oss_20b_packed_16384", "gpt-oss-20b", 1, 16384, packed=True, mean_doc_len=300),
    Workload("qwen3_30b_a3b_4096", "qwen3-30b-a3b", 1, 4096),
    Workload("qwen3_30b_a3b_packed_16384", "qwen3-30b-a3b", 1, 16384, packed=True, mean_doc_len=300),
    Workload("qwen2_5_vl_7b_448", "qwen2.5-vl-7b", 1, 4096, image_size=448),
    Workload("qwen2_5_vl_7b_1024", "qwen2.5-vl-7b", 1, 4096, image_size=1024),
    Workload("tiny_llama", "tiny-llama", 2, 128, tiny=True),
    Workload("tiny_qwen3_moe", "tiny-qwen3-moe", 1, 256, tiny=True),
    Workload("tiny_qwen3_moe_packed", "tiny-qwen3-moe", 1, 256, packed=True, mean_doc_len=40, tiny=True),
    Workload("tiny_qwen2_5_vl", "tiny-qwen2.5-vl", 1, 128, image_size=140, tiny=True),
    Workload("tiny_gpt_oss", "tiny-gpt-oss", 1, 256, tiny=True),
    Workload("tiny_gpt_oss_packed", "tiny-gpt-oss", 1, 256, packed=True, mean_doc_len=40, tiny=True),
    Workload("tiny_gemma2", "tiny-gemma2", 1, 128, tiny=True),
    Workload("tiny_gemma3", "tiny-gemma3", 1, 128, tiny=True),
    Workload("tiny_qwen3", "tiny-qwen3", 1, 128, tiny=True),
    Workload("tiny_packed", "tiny-llama", 1, 128, packed=True, mean_doc_len=24, tiny=True),
)}
DEFAULT_WORKLOADS = ("1b_2x4096", "8b_4096", "8b_16384", "qwen3_8b_4096", "8b_packed_16384")
TINY_WORKLOADS = ("tiny_llama", "tiny_qwen3", "tiny_packed")


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None


# --------------------------------------------------------------------------------------------
# Token data.
# --------------------------------------------------------------------------------------------


IMAGE_TEXT_PREFIX = 16  # text tokens before an image row's <|vision_start|> (a user turn's opening words)


@dataclasses.dataclass(frozen=True)
class TokenData:
    """Host numpy arrays with a leading step axis S (one batch per optimizer step).

    jaxft contract (see CONVENTIONS.md): input_ids, targets (next token, 0 where masked),
    loss_mask (1.0 where the target counts), segment_ids (documents 1..n per row), positions
    (restart at 0 per document); all [S, B, T].
    HF contract: ``labels`` [S, B, T] int64 is input_ids with -100 at every document start (and at
    every image token); HF shifts it inside the loss, so the target of position t is labels[t + 1] =
    targets[t] and the masked ones agree with loss_mask == 0. ``position_ids`` = positions (int64).
    Image rows (vision-language workloads) add, in jaxft's packed-batch form (jaxft.data.packing),
    pixel_values [S, B, P * patch_dim] float32 (the image processor's patches of the row's image) and
    image_grid_thw [S, B, 3] int32; ``hf_images(i)`` gives transformers' flat form of step i.
    """

    input_ids: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    attention_pairs: np.ndarray  # [S] causal within-document (query, key) pairs, summed over rows
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None
    image_token_id: int | None = None

    def step(self, i: int) -> dict[str, np.ndarray]:
        """The jaxft packed-batch dict of step i."""
        out = {"input_ids": self.input_ids[i], "targets": self.targets[i],
               "loss_mask": self.loss_mask[i], "segment_ids": self.segment_ids[i],
               "positions": self.positions[i]}
        if self.pixel_values is not None:
            out.update(pixel_values=self.pixel_values[i], image_grid_thw=self.image_grid_thw[i])
        return out

    def rows(self, start: int, stop: int) -> "TokenData":
        """Rows start..stop-1 of every step (one data-parallel rank's share of a global batch); attention_pairs
        counted again for those rows."""
        cut = {f.name: getattr(self, f.name)[:, start:stop] for f in dataclasses.fields(self)
               if f.name not in ("attention_pairs", "image_token_id") and getattr(self, f.name) is not None}
        return dataclasses.replace(self, **cut, attention_pairs=causal_pairs(cut["segment_ids"]))

    def hf_images(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(pixel_values [patches of every row, patch_dim] float32, image_grid_thw [rows, 3] int64) of step
        i: what transformers' Qwen2.5-VL processor returns for the batch's images, rows in order."""
        grids = self.image_grid_thw[i].reshape(-1, 3).astype(np.int64)
        dim = self.pixel_values.shape[-1] // int(grids[0].prod())
        return self.pixel_values[i].reshape(-1, dim), grids

    def hf_vision_inputs(self, i: int) -> dict[str, np.ndarray]:
        """The vision keyword arguments of step i for transformers' Qwen2.5-VL forward: `hf_images` and
        mm_token_type_ids [B, T] (1 on image tokens, 0 on text, as its processor returns them). Without
        mm_token_type_ids transformers 5 computes no M-RoPE positions: its text model silently takes 1-D
        positions arange(T), which shift every text token after an image (found on the H200: HF+PEFT and
        Unsloth trained the 7B rows that way; docs/benchmarks.md section 20)."""
        pixels, grids = self.hf_images(i)
        return {"pixel_values": pixels, "image_grid_thw": grids,
                "mm_token_type_ids": (self.input_ids[i] == self.image_token_id).astype(np.int64)}

    def image_grids(self, i: int) -> list[tuple[int, int, int]]:
        """The (t, h, w) patch grid of every image of step i ([] for text-only data)."""
        if self.image_grid_thw is None:
            return []
        return [tuple(int(v) for v in g) for g in self.image_grid_thw[i].reshape(-1, 3)]

    def hf_labels(self) -> np.ndarray:
        labels = self.input_ids.astype(np.int64)
        labels[self.positions == 0] = -100
        if self.image_token_id is not None:
            labels[self.input_ids == self.image_token_id] = -100
        return labels

    @property
    def sha256(self) -> str:
        h = hashlib.sha256()
        arrays = [self.input_ids, self.positions, self.loss_mask]
        if self.pixel_values is not None:  # every system must see the same pixels too
            arrays += [self.pixel_values, self.image_grid_thw]
        for a in arrays:
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()

    def stats(self) -> dict[str, Any]:
        starts = int((self.positions == 0).sum())
        out = {"steps": int(self.input_ids.shape[0]), "documents": starts,
               "mean_doc_len": float(self.input_ids.size / starts),
               "loss_tokens_per_step": float(self.loss_mask.sum() / self.input_ids.shape[0]),
               "sha256": self.sha256}
        if self.image_token_id is not None:
            out["image_tokens_per_step"] = float((self.input_ids == self.image_token_id).sum()
                                                 / self.input_ids.shape[0])
            out["patches_per_step"] = float(sum(t * h * w for t, h, w in self.image_grids(0)))
        return out


def _doc_lengths(rng: np.random.Generator, seq_len: int, mean: int) -> np.ndarray:
    """Lognormal lengths with the given mean (mu = ln(mean) - sigma^2 / 2), last one cut to fit."""
    mu = np.log(mean) - PACKED_DOC_SIGMA ** 2 / 2
    out: list[int] = []
    total = 0
    while total < seq_len:
        n = int(np.clip(np.rint(rng.lognormal(mu, PACKED_DOC_SIGMA)), PACKED_MIN_DOC, seq_len))
        n = min(n, seq_len - total)
        out.append(n)
        total += n
    return np.asarray(out, dtype=np.int64)


def image_processor(shape: ModelShape):
    """transformers' Qwen2-VL image processor of a vision-language shape, the PIL backend named explicitly:
    every worker then computes the same pixels (the torchvision backend resizes slightly differently), and
    the same class is what jaxft's AutoImageProcessor picks on a host without torchvision."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = {k: v for k, v in shape.processor_config.items() if k not in ("image_processor_type", "processor_class")}
    return Qwen2VLImageProcessorPil(**cfg)


def synthetic_image(rng: np.random.Generator, size: int) -> np.ndarray:
    """A size x size RGB uint8 image of uniform noise (no resize can make two processors agree on noise
    they did not both see: the pixels, not the file, are what every system is given)."""
    return rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)


def text_vocab_below(shape: ModelShape) -> int:
    """Synthetic text ids are drawn below this: the vocabulary, or a VLM's lowest vision special id (an
    image pad id drawn into the text would be read as an image token)."""
    ids = [shape.get(k) for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id",
                                  "video_token_id") if shape.has(k)]
    return min([int(shape.get("vocab_size"))] + [int(i) for i in ids])


def _image_rows(workload: Workload, steps: int, input_ids: np.ndarray, loss_mask: np.ndarray):
    """Put one image per row into ``input_ids`` (in place): prefix text, <|vision_start|>, one image pad per
    merged patch, <|vision_end|>, text; mask the targets that are image pads. Returns (pixel_values,
    image_grid_thw) in the jaxft batch form."""
    from PIL import Image

    shape = workload.shape
    proc = image_processor(shape)
    rng = np.random.Generator(np.random.PCG64(workload.seed + 1))
    b = workload.batch
    pixels, grids = [], []
    for i in range(steps):
        for j in range(b):
            out = proc(images=[Image.fromarray(synthetic_image(rng, workload.image_size))], return_tensors="np")
            grid = np.asarray(out["image_grid_thw"][0], np.int64)
            n = int(grid.prod()) // int(proc.merge_size) ** 2
            end = IMAGE_TEXT_PREFIX + n + 2
            if end >= workload.seq_len:
                raise ValueError(f"Workload {workload.name!r}: a {workload.image_size}px image takes {n} tokens; "
                                 f"seq_len={workload.seq_len} must exceed {end}")
            row = input_ids[i, j]
            row[IMAGE_TEXT_PREFIX] = shape.get("vision_start_token_id")
            row[IMAGE_TEXT_PREFIX + 1:end - 1] = shape.get("image_token_id")
            row[end - 1] = shape.get("vision_end_token_id")
            pixels.append(np.asarray(out["pixel_values"], np.float32).reshape(-1))
            grids.append(grid.astype(np.int32))
    image = input_ids == shape.get("image_token_id")
    loss_mask[..., :-1][image[..., 1:]] = 0  # an image pad is an input, never a target
    return (np.stack(pixels).reshape(steps, b, -1), np.stack(grids).reshape(steps, b, 3))


def causal_pairs(segment_ids: np.ndarray) -> np.ndarray:
    """[S] causal within-document (query, key) pairs, diagonal included, summed over the rows of each step of
    segment_ids [S, B, T]: n (n + 1) / 2 per document of n tokens. (kernels_pallas.attention.kept_pairs counts the
    same on device; this module stays free of JAX for the torch workers.)"""
    out = np.zeros(segment_ids.shape[0], np.int64)
    for i, step in enumerate(segment_ids):
        for row in step:
            n = np.bincount(row).astype(np.int64)
            out[i] += int((n * (n + 1) // 2).sum())
    return out


def make_token_data(workload: Workload, steps: int) -> TokenData:
    """Deterministic token data for ``steps`` optimizer steps (seeded by the workload name).

    Token ids are uniform over the vocabulary (below a VLM's special ids); the same call gives the same
    bytes in every process, which each worker proves by reporting ``TokenData.sha256`` (pixels included).
    """
    if steps < 1:
        raise ValueError(f"make_token_data: steps={steps} must be >= 1")
    rng = np.random.Generator(np.random.PCG64(workload.seed))
    s, b, t = steps, workload.batch, workload.seq_len
    vocab = text_vocab_below(workload.shape)
    input_ids = rng.integers(0, vocab, size=(s, b, t), dtype=np.int64).astype(np.int32)
    positions = np.empty((s, b, t), np.int32)
    segment_ids = np.empty((s, b, t), np.int32)
    for i in range(s):
        for j in range(b):
            if workload.packed:
                lengths = _doc_lengths(rng, t, workload.mean_doc_len)
            else:
                lengths = np.asarray([t], np.int64)
            positions[i, j] = np.concatenate([np.arange(n) for n in lengths])
            segment_ids[i, j] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    loss_mask = np.zeros((s, b, t), np.float32)
    loss_mask[..., :-1] = positions[..., 1:] != 0  # no target across a document boundary
    images: dict[str, Any] = {}
    if workload.image_size:
        pixel_values, grid = _image_rows(workload, s, input_ids, loss_mask)
        images = {"pixel_values": pixel_values, "image_grid_thw": grid,
                  "image_token_id": int(workload.shape.get("image_token_id"))}
    targets = np.zeros_like(input_ids)
    targets[..., :-1] = input_ids[..., 1:]
    targets[loss_mask == 0] = 0
    return TokenData(input_ids, targets, loss_mask, segment_ids, positions, causal_pairs(segment_ids), **images)


# --------------------------------------------------------------------------------------------
# FLOPs.
# --------------------------------------------------------------------------------------------

FLOP_FORMULA = ("useful_flops/step = tokens * (4 * P_frozen + 6 * P_lora) + 12 * L * H_q * D * pairs "
                "[+ VLM: vision tower forward 2 * P_vision per patch + 4 * D_v * H_v * vision pairs]; "
                "P_frozen = frozen matmul params a token runs (q,k,v,o,gate,up,down per layer + lm_head; "
                "MoE: router + the top-k experts' gate_up/down, not all experts), "
                "P_lora = r * (in + out) per adapted linear (MoE expert LoRA: top-k experts' factors), "
                "pairs = causal within-document (query, key) pairs incl. the diagonal (T(T+1)/2 per "
                "unpacked row); VLM tokens = text + image tokens; "
                "MFU = useful_flops / median_step_time / bf16 matmul ceiling measured in this run")


@dataclasses.dataclass(frozen=True)
class MoeLayout:
    """A mixture-of-experts shape: E experts of width I, top_k per token, on the layers ``sparse`` marks."""

    num_experts: int
    top_k: int
    width: int
    sparse: tuple[bool, ...]


def moe_layout(shape: ModelShape) -> MoeLayout | None:
    """The shape's experts (None for a dense model), with transformers' rule for which layers are sparse."""
    cfg, layers = shape.hf_config, shape.get("num_hidden_layers")
    if cfg["model_type"] == "gpt_oss":
        return MoeLayout(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"],
                         (True,) * layers)
    if cfg["model_type"] == "qwen3_moe":
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        only, step = cfg.get("mlp_only_layers") or [], cfg.get("decoder_sparse_step", 1)
        return MoeLayout(experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                         tuple(i not in only and experts > 0 and (i + 1) % step == 0 for i in range(layers)))
    return None


def linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) of each per-layer linear of a dense layer."""
    h, i = shape.get("hidden_size"), shape.get("intermediate_size")
    q, kv = shape.get("num_attention_heads") * shape.get("head_dim"), \
        shape.get("num_key_value_heads") * shape.get("head_dim")
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def lora_module_targets(shape: ModelShape, lora: LoraSettings = LORA) -> tuple[str, ...]:
    """The Linear modules every system adapts (PEFT target_modules): lora.targets, but on a MoE shape whose
    layers are all sparse only the attention ones. No gate/up/down_proj Linear exists there (jaxft refuses
    a target that matches nothing) and, worse, PEFT >= 0.21 on transformers 5 rewrites gate_proj/up_proj
    targets of a Qwen3-MoE into expert LoRA on the fused gate_up_proj at rank 2r and alpha 2 alpha
    (peft.utils.transformers_weight_conversion, the v4 -> v5 MoE conversion): the experts are adapted
    through target_parameters = lora.expert_targets instead, at rank r in every system."""
    moe = moe_layout(shape)
    if moe is not None and all(moe.sparse):
        return tuple(t for t in lora.targets if t in ATTENTION_TARGETS)
    return tuple(lora.targets)


def expert_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) of one expert's matmuls, keyed by the PEFT target_parameters name (gate and up fused)."""
    moe = moe_layout(shape)
    h = shape.get("hidden_size")
    return {"experts.gate_up_proj": (h, 2 * moe.width), "experts.down_proj": (moe.width, h)}


def param_counts(shape: ModelShape, lora: LoraSettings = LORA) -> dict[str, int]:
    """Frozen matmul parameters and LoRA parameters of the language model.

    frozen_matmul / lora_active: what one token runs through (the FLOP basis: a MoE layer's router and
    top-k experts); stored_matmul / lora: what exists (every expert; lora is the trainable count every
    system reports). Dense shapes: active == stored.
    """
    layers = shape.get("num_hidden_layers")
    lin = linear_shapes(shape)
    attn, mlp = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
    moe = moe_layout(shape)
    counts = dict.fromkeys(("frozen_matmul", "stored_matmul", "lora", "lora_active"), 0)
    for layer in range(layers):
        sparse = moe is not None and moe.sparse[layer]
        frozen = sum(a * b for n, (a, b) in lin.items() if n in attn)
        adapted = sum(lora.r * (a + b) for n, (a, b) in lin.items() if n in attn and n in lora.targets)
        active = stored = frozen
        lora_active = lora_stored = adapted
        if sparse:
            experts = expert_shapes(shape)
            router = shape.get("hidden_size") * moe.num_experts
            one = sum(a * b for a, b in experts.values())
            one_lora = sum(lora.r * (a + b) for n, (a, b) in experts.items() if n in lora.expert_targets)
            active += router + moe.top_k * one
            stored += router + moe.num_experts * one
            lora_active += moe.top_k * one_lora
            lora_stored += moe.num_experts * one_lora
        else:
            dense = sum(a * b for n, (a, b) in lin.items() if n in mlp)
            dense_lora = sum(lora.r * (a + b) for n, (a, b) in lin.items() if n in mlp and n in lora.targets)
            active, stored = active + dense, stored + dense
            lora_active, lora_stored = lora_active + dense_lora, lora_stored + dense_lora
        counts["frozen_matmul"] += active
        counts["stored_matmul"] += stored
        counts["lora_active"] += lora_active
        counts["lora"] += lora_stored
    head = shape.get("hidden_size") * shape.get("vocab_size")  # lm_head (tied or not)
    counts["frozen_matmul"] += head
    counts["stored_matmul"] += head
    if shape.is_vlm:
        counts.update({f"vision_{k}": v for k, v in vision_params(shape).items()})
    return {k: int(v) for k, v in counts.items()}


def vision_params(shape: ModelShape) -> dict[str, int]:
    """Matmul parameters of a Qwen2.5-VL vision tower: per patch (the patch embedding, a matmul of the
    3 * temporal * patch^2 pixel values, and every block's qkv, proj, gate, up, down) and per merged token
    (the merger's two linears over merge^2 concatenated patches)."""
    v = shape.get("vision_config")
    hv, iv = v["hidden_size"], v["intermediate_size"]
    patch_in = v["in_channels"] * v["temporal_patch_size"] * v["patch_size"] ** 2
    block = hv * 3 * hv + hv * hv + 2 * hv * iv + iv * hv
    merged = hv * v["spatial_merge_size"] ** 2
    return {"per_patch": patch_in * hv + v["depth"] * block,
            "per_merged": merged * merged + merged * v["out_hidden_size"]}


def vision_attention_pairs(shape: ModelShape, grid: tuple[int, int, int]) -> dict[str, int]:
    """(query, key) pairs of one image in the tower's attention, per block kind: a full-attention block attends
    within the image (N^2 for N patches), a window block within windows of window_size pixels on the merged
    grid (edge windows partial), as transformers' Qwen2_5_VisionTransformer.get_window_index cuts them."""
    v = shape.get("vision_config")
    m = v["spatial_merge_size"]
    t, h, w = grid
    win = v["window_size"] // m // v["patch_size"]  # window side in merged tokens
    hm, wm = h // m, w // m
    sides_h = [min(win, hm - a) for a in range(0, hm, win)]
    sides_w = [min(win, wm - a) for a in range(0, wm, win)]
    window = t * sum((a * b * m * m) ** 2 for a in sides_h for b in sides_w)
    return {"full": (t * h * w) ** 2, "window": window}


def useful_flops(shape: ModelShape, tokens: int, pairs: int, lora: LoraSettings = LORA,
                 image_grids: list[tuple[int, int, int]] | tuple = ()) -> float:
    """Useful FLOPs of one optimizer step (see the module docstring and FLOP_FORMULA)."""
    p = param_counts(shape, lora)
    attn = 12 * shape.get("num_hidden_layers") * shape.get("num_attention_heads") \
        * shape.get("head_dim") * pairs
    flops = float(tokens) * (4 * p["frozen_matmul"] + 6 * p["lora_active"]) + float(attn)
    if image_grids:
        v = shape.get("vision_config")
        full = len(v["fullatt_block_indexes"])
        head_dim = v["hidden_size"] // v["num_heads"]
        for grid in image_grids:
            patches = grid[0] * grid[1] * grid[2]
            vp = vision_attention_pairs(shape, grid)
            flops += 2.0 * (p["vision_per_patch"] * patches
                            + p["vision_per_merged"] * patches // v["spatial_merge_size"] ** 2)
            flops += 4.0 * head_dim * v["num_heads"] * (full * vp["full"] + (v["depth"] - full) * vp["window"])
    return flops
