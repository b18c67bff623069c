"""Workload definitions shared by every system of the training benchmark.

Everything a worker needs to train "the same thing" lives here and nowhere else:

* the model shapes (Hugging Face config dicts of the real models; weights are random),
* the workloads (shape x batch x sequence length x packing),
* the LoRA and optimizer settings,
* the token data (seeded numpy, identical for every system; checked by a SHA-256),
* the useful-FLOP formula used for MFU.

Useful FLOPs of one optimizer step (the formula printed in every report):

    useful = tokens * (4 * P_frozen + 6 * P_lora) + 12 * L * H_q * D * pairs

* ``P_frozen``: parameters of the frozen matmuls (q, k, v, o, gate, up, down of every layer plus
  the lm_head; the embedding lookup is not a matmul). Forward costs 2 FLOPs per parameter and
  token, backward 2 more for the input gradient; the frozen weights get no weight gradient.
* ``P_lora``: LoRA parameters (r * (in + out) per adapted linear): forward 2, input gradient 2,
  weight gradient 2.
* attention: per layer and head, QK^T and PV cost 2 * D FLOPs per (query, key) pair each in the
  forward (4 * D), the backward twice that, so 12 * D per pair. ``pairs`` counts the causal
  (query, key) pairs that are allowed, diagonal included: T (T + 1) / 2 for a plain row, and the
  sum of n (n + 1) / 2 over the documents of a packed row (cross-document pairs are not useful).
* Not counted: norms, activations, softmax, the loss, recomputation by gradient checkpointing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import zlib
from typing import Any, Mapping

import numpy as np

# --------------------------------------------------------------------------------------------
# Training settings shared by every system.
# --------------------------------------------------------------------------------------------

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """LoRA on every target linear: y = W x + (alpha / r) * B (A x); dropout off, no bias."""

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        if self.r <= 0 or self.alpha <= 0:
            raise ValueError(f"LoraSettings: r={self.r} and alpha={self.alpha} must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoraSettings: dropout={self.dropout} must be in [0, 1)")
        unknown = set(self.targets) - set(LORA_TARGETS)
        if unknown:
            raise ValueError(f"LoraSettings: unknown targets {sorted(unknown)}; known {LORA_TARGETS}")


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
    """A named HF config dict (transformers 5 keys: ``rope_parameters``, not ``rope_scaling``)."""

    name: str
    hf_config: Mapping[str, Any]

    def __post_init__(self) -> None:
        need = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                "tie_word_embeddings")
        missing = [k for k in need if k not in self.hf_config]
        if missing:
            raise ValueError(f"ModelShape {self.name!r}: hf_config lacks keys {missing}")
        if self.hf_config["num_attention_heads"] % self.hf_config["num_key_value_heads"]:
            raise ValueError(f"ModelShape {self.name!r}: num_attention_heads must be a multiple "
                             "of num_key_value_heads")

    def get(self, key: str) -> Any:
        return self.hf_config[key]

    def config_dict(self) -> dict[str, Any]:
        """A fresh, JSON-serialisable copy (nested dicts copied too)."""
        return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in self.hf_config.items()}


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
    # Tiny shapes for the CPU smoke test (--tiny): same families, same code paths.
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
    """

    name: str
    shape_name: str
    batch: int
    seq_len: int
    packed: bool = False
    mean_doc_len: int = 0
    tiny: bool = False

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
    Workload("qwen3_8b_4096", "qwen3-8b", 1, 4096),
    Workload("8b_packed_16384", "llama-3.1-8b", 1, 16384, packed=True, mean_doc_len=300),
    Workload("gemma2_9b_4096", "gemma-2-9b", 1, 4096),
    Workload("gemma2_9b_packed_16384", "gemma-2-9b", 1, 16384, packed=True, mean_doc_len=300),
    Workload("gemma3_12b_4096", "gemma-3-12b", 1, 4096),
    Workload("gemma3_12b_packed_16384", "gemma-3-12b", 1, 16384, packed=True, mean_doc_len=300),
    Workload("gpt_oss_20b_4096", "gpt-oss-20b", 1, 4096),
    Workload("gpt_oss_20b_packed_16384", "gpt-oss-20b", 1, 16384, packed=True, mean_doc_len=300),
    Workload("tiny_llama", "tiny-llama", 2, 128, tiny=True),
    Workload("tiny_gpt_oss", "tiny-gpt-oss", 1, 256, tiny=True),
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


@dataclasses.dataclass(frozen=True)
class TokenData:
    """Host numpy arrays with a leading step axis S (one batch per optimizer step).

    jaxft contract (see CONVENTIONS.md): input_ids, targets (next token, 0 where masked),
    loss_mask (1.0 where the target counts), segment_ids (documents 1..n per row), positions
    (restart at 0 per document); all [S, B, T].
    HF contract: ``labels`` [S, B, T] int64 is input_ids with -100 at every document start; HF
    shifts it inside the loss, so the target of position t is labels[t + 1] = targets[t] and the
    masked ones agree with loss_mask == 0. ``position_ids`` = positions (int64).
    """

    input_ids: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    attention_pairs: np.ndarray  # [S] causal within-document (query, key) pairs, summed over rows

    def step(self, i: int) -> dict[str, np.ndarray]:
        """The jaxft packed-batch dict of step i."""
        return {"input_ids": self.input_ids[i], "targets": self.targets[i],
                "loss_mask": self.loss_mask[i], "segment_ids": self.segment_ids[i],
                "positions": self.positions[i]}

    def hf_labels(self) -> np.ndarray:
        labels = self.input_ids.astype(np.int64)
        labels[self.positions == 0] = -100
        return labels

    @property
    def sha256(self) -> str:
        h = hashlib.sha256()
        for a in (self.input_ids, self.positions, self.loss_mask):
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()

    def stats(self) -> dict[str, Any]:
        starts = int((self.positions == 0).sum())
        return {"steps": int(self.input_ids.shape[0]), "documents": starts,
                "mean_doc_len": float(self.input_ids.size / starts),
                "loss_tokens_per_step": float(self.loss_mask.sum() / self.input_ids.shape[0]),
                "sha256": self.sha256}


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


def make_token_data(workload: Workload, steps: int) -> TokenData:
    """Deterministic token data for ``steps`` optimizer steps (seeded by the workload name).

    Token ids are uniform over the vocabulary; the same call gives the same bytes in every
    process, which each worker proves by reporting ``TokenData.sha256``.
    """
    if steps < 1:
        raise ValueError(f"make_token_data: steps={steps} must be >= 1")
    rng = np.random.Generator(np.random.PCG64(workload.seed))
    s, b, t = steps, workload.batch, workload.seq_len
    vocab = int(workload.shape.get("vocab_size"))
    input_ids = rng.integers(0, vocab, size=(s, b, t), dtype=np.int64).astype(np.int32)
    positions = np.empty((s, b, t), np.int32)
    segment_ids = np.empty((s, b, t), np.int32)
    pairs = np.zeros((s,), np.int64)
    for i in range(s):
        for j in range(b):
            if workload.packed:
                lengths = _doc_lengths(rng, t, workload.mean_doc_len)
            else:
                lengths = np.asarray([t], np.int64)
            positions[i, j] = np.concatenate([np.arange(n) for n in lengths])
            segment_ids[i, j] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
            pairs[i] += int((lengths * (lengths + 1) // 2).sum())
    targets = np.zeros_like(input_ids)
    targets[..., :-1] = input_ids[..., 1:]
    loss_mask = np.zeros((s, b, t), np.float32)
    loss_mask[..., :-1] = positions[..., 1:] != 0  # no target across a document boundary
    targets[loss_mask == 0] = 0
    return TokenData(input_ids, targets, loss_mask, segment_ids, positions, pairs)


# --------------------------------------------------------------------------------------------
# FLOPs.
# --------------------------------------------------------------------------------------------

FLOP_FORMULA = ("useful_flops/step = tokens * (4 * P_frozen + 6 * P_lora) + 12 * L * H_q * D * pairs; "
                "P_frozen = frozen matmul params (q,k,v,o,gate,up,down per layer + lm_head), "
                "P_lora = r * (in + out) per adapted linear, pairs = causal within-document "
                "(query, key) pairs incl. the diagonal (T(T+1)/2 per unpacked row); "
                "MFU = useful_flops / median_step_time / bf16 matmul ceiling measured in this run")


def linear_shapes(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in, out) of each per-layer linear."""
    h, i = shape.get("hidden_size"), shape.get("intermediate_size")
    q, kv = shape.get("num_attention_heads") * shape.get("head_dim"), \
        shape.get("num_key_value_heads") * shape.get("head_dim")
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def param_counts(shape: ModelShape, lora: LoraSettings = LORA) -> dict[str, int]:
    """Frozen matmul parameters (layers + lm_head) and LoRA parameters."""
    layers = shape.get("num_hidden_layers")
    lin = linear_shapes(shape)
    experts_per_token = shape.hf_config.get("num_experts_per_tok", 1) if "num_local_experts" in shape.hf_config else 1
    # Per token a mixture-of-experts layer runs its top-k experts' MLPs (the FLOPs that count), not all of them.
    frozen = layers * sum(a * b * (experts_per_token if name.endswith(("gate_proj", "up_proj", "down_proj")) else 1)
                          for name, (a, b) in lin.items())
    frozen += shape.get("hidden_size") * shape.get("vocab_size")  # lm_head (tied or not)
    # A mixture-of-experts MLP has no Linear modules: "all-linear" LoRA adapts the attention projections only there.
    targets = [t for t in lora.targets if experts_per_token == 1 and "num_local_experts" not in shape.hf_config
               or not t.endswith(("gate_proj", "up_proj", "down_proj"))]
    lora_p = layers * sum(lora.r * (lin[t][0] + lin[t][1]) for t in targets)
    return {"frozen_matmul": int(frozen), "lora": int(lora_p)}


def useful_flops(shape: ModelShape, tokens: int, pairs: int, lora: LoraSettings = LORA) -> float:
    """Useful FLOPs of one optimizer step (see the module docstring and FLOP_FORMULA)."""
    p = param_counts(shape, lora)
    attn = 12 * shape.get("num_hidden_layers") * shape.get("num_attention_heads") \
        * shape.get("head_dim") * pairs
    return float(tokens) * (4 * p["frozen_matmul"] + 6 * p["lora"]) + float(attn)
