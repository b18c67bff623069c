"""Shared helpers for the bridge tests (no tests here): tiny HF models and the test oracle.

The oracle (``ORACLE_NAMES``, ``expected_for``) is written independently of
``bridge.mappings``: our tree paths and shapes come from the conventions doc and
the HF config, HF names from transformers' module layout.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
import transformers

# Small but non-square everywhere (hidden != heads*head_dim != kv*head_dim != intermediate != vocab)
# so a missing or wrong transpose cannot go unnoticed.
_DIMS = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

ARCHS = {
    "llama": (transformers.LlamaConfig, dict(head_dim=16, tie_word_embeddings=False)),
    "llama_bias": (
        transformers.LlamaConfig,
        dict(head_dim=16, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    ),
    "mistral": (transformers.MistralConfig, dict(head_dim=16, tie_word_embeddings=False)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=False)),
}

# our path -> (HF name template, HF stores it transposed [out, in])
ORACLE_NAMES = {
    ("embed", "embedding"): ("model.embed_tokens.weight", False),
    ("lm_head", "kernel"): ("lm_head.weight", True),
    ("final_norm", "scale"): ("model.norm.weight", False),
    ("layers", "input_norm", "scale"): ("model.layers.{}.input_layernorm.weight", False),
    ("layers", "post_attn_norm", "scale"): ("model.layers.{}.post_attention_layernorm.weight", False),
    ("layers", "attn", "q_norm", "scale"): ("model.layers.{}.self_attn.q_norm.weight", False),
    ("layers", "attn", "k_norm", "scale"): ("model.layers.{}.self_attn.k_norm.weight", False),
}
for _proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
    ORACLE_NAMES[("layers", "attn", _proj, "kernel")] = (f"model.layers.{{}}.self_attn.{_proj}.weight", True)
    ORACLE_NAMES[("layers", "attn", _proj, "bias")] = (f"model.layers.{{}}.self_attn.{_proj}.bias", False)
for _proj in ("gate_proj", "up_proj", "down_proj"):
    ORACLE_NAMES[("layers", "mlp", _proj, "kernel")] = (f"model.layers.{{}}.mlp.{_proj}.weight", True)
    ORACLE_NAMES[("layers", "mlp", _proj, "bias")] = (f"model.layers.{{}}.mlp.{_proj}.bias", False)


def make_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    """A tiny random HF causal LM; every parameter (norms included) is random so swaps show."""
    cls, extra = ARCHS[arch]
    config = cls(**_DIMS, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model.to(dtype).eval()


def expected_for(config: transformers.PretrainedConfig, dtype=np.float32) -> dict[tuple, tuple]:
    """Tree paths and shapes the model has, from the HF config (the `expected` of load_weights)."""
    c = config
    n_layers, hidden, inter, vocab = c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size
    head_dim = getattr(c, "head_dim", None) or hidden // c.num_attention_heads
    nq, nkv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    L = n_layers
    shapes = {
        ("embed", "embedding"): (vocab, hidden),
        ("final_norm", "scale"): (hidden,),
        ("layers", "input_norm", "scale"): (L, hidden),
        ("layers", "post_attn_norm", "scale"): (L, hidden),
        ("layers", "attn", "q_proj", "kernel"): (L, hidden, nq),
        ("layers", "attn", "k_proj", "kernel"): (L, hidden, nkv),
        ("layers", "attn", "v_proj", "kernel"): (L, hidden, nkv),
        ("layers", "attn", "o_proj", "kernel"): (L, nq, hidden),
        ("layers", "mlp", "gate_proj", "kernel"): (L, hidden, inter),
        ("layers", "mlp", "up_proj", "kernel"): (L, hidden, inter),
        ("layers", "mlp", "down_proj", "kernel"): (L, inter, hidden),
    }
    if not c.tie_word_embeddings:
        shapes[("lm_head", "kernel")] = (hidden, vocab)
    if c.model_type == "qwen2" or getattr(c, "attention_bias", False):
        shapes[("layers", "attn", "q_proj", "bias")] = (L, nq)
        shapes[("layers", "attn", "k_proj", "bias")] = (L, nkv)
        shapes[("layers", "attn", "v_proj", "bias")] = (L, nkv)
    if c.model_type != "qwen2" and getattr(c, "attention_bias", False):
        shapes[("layers", "attn", "o_proj", "bias")] = (L, hidden)
    if getattr(c, "mlp_bias", False):
        shapes[("layers", "mlp", "gate_proj", "bias")] = (L, inter)
        shapes[("layers", "mlp", "up_proj", "bias")] = (L, inter)
        shapes[("layers", "mlp", "down_proj", "bias")] = (L, hidden)
    if c.model_type == "qwen3":
        shapes[("layers", "attn", "q_norm", "scale")] = (L, head_dim)
        shapes[("layers", "attn", "k_norm", "scale")] = (L, head_dim)
    return {p: (s, dtype) for p, s in shapes.items()}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Exact numpy copy of a torch tensor (bf16 through its bit pattern)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def oracle_tensor(state: dict[str, torch.Tensor], path: tuple, num_layers: int) -> np.ndarray:
    """Our-layout array for `path` built from an HF state dict by the oracle mapping."""
    template, transposed = ORACLE_NAMES[path]
    if "{}" not in template:
        x = to_numpy(state[template])
        return x.T if transposed else x
    per_layer = [to_numpy(state[template.format(i)]) for i in range(num_layers)]
    return np.stack([x.T if transposed else x for x in per_layer])


def bits(x: np.ndarray) -> np.ndarray:
    """Bit pattern view for exact comparisons (NaN-safe, -0.0-sensitive)."""
    return np.ascontiguousarray(x).view(f"u{np.dtype(x.dtype).itemsize}")
