"""Logit parity of jaxft's decoder with transformers (the oracle), on tiny random models built here.

Every variant the foundation issue lists: llama3 / yarn / linear / dynamic RoPE, tied and untied embeddings,
GQA, a head_dim that differs from hidden/heads, q/k/v bias (Qwen2), per-head q/k norm (Qwen3), sliding
windows shorter than the input (Mistral, Qwen2 layer types). Inputs are >= 512 tokens so RoPE errors show.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import jax
import jax.numpy as jnp
from flax import nnx

import jaxft
from jaxft.config import ModelConfig
from jaxft.models import abstract_model

SEQ = 576
VOCAB = 256
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6)

VARIANTS = {
    "llama3_untied_gqa": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
                                        tie_word_embeddings=False)),
    "llama_yarn_tied": ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 256},
                                      tie_word_embeddings=True)),
    "llama_linear_mha": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, num_key_value_heads=4,
                                       head_dim=16, attention_bias=True, mlp_bias=True)),
    "llama_dynamic_beyond_max": ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                                               max_position_embeddings=256)),
    "mistral_window": ("mistral", dict(sliding_window=100)),
    "qwen2_bias_window_layers": ("qwen2", dict(use_sliding_window=True, sliding_window=128, max_window_layers=1,
                                               layer_types=["full_attention", "sliding_attention"])),
    "qwen3_qknorm": ("qwen3", dict(rope_theta=1e6)),
}


def _hf_model(model_type: str, overrides: dict, seed: int = 0):
    kw = {**BASE, **overrides}
    if "rope_theta" in kw:
        theta = kw.pop("rope_theta")
        kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": theta})
    config = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():
        # Default init leaves norms at 1 and biases at 0: randomise them so a mis-mapped tensor shows.
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model.eval()


def _hf_logits(model, ids, position_ids=None):
    with torch.no_grad():
        kw = {} if position_ids is None else {"position_ids": torch.tensor(position_ids)}
        return model(torch.tensor(ids), **kw).logits.float().numpy()


# Forwards jitted, one program per model and shape (op by op, every eager op of a new shape compiles on its own).
_forward = nnx.jit(lambda m, ids: m(ids))
_packed_forward = nnx.jit(lambda m, ids, seg: m(ids, segment_ids=seg))
_positioned_forward = nnx.jit(lambda m, ids, pos: m(ids, positions=pos))


def _rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    out = {}
    for name, (model_type, overrides) in VARIANTS.items():
        model = _hf_model(model_type, overrides)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path, safe_serialization=True)
        out[name] = (model, path)
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(saved_models, variant):
    hf, path = saved_models[variant]
    ids = np.random.default_rng(1).integers(0, VOCAB, size=(2, SEQ))
    model = jaxft.from_pretrained(path, dtype="float32")
    ours = np.asarray(_forward(model, ids))
    assert ours.shape == (2, SEQ, VOCAB)
    assert _rel_err(ours, _hf_logits(hf, ids)) <= 1e-4


# Two packing paths: full causal masks, and sliding windows on some layers (q/k norms act per token: no third).
@pytest.mark.parametrize("variant", ["llama3_untied_gqa", "qwen2_bias_window_layers"])
def test_packed_row_equals_documents_alone(saved_models, variant):
    hf, path = saved_models[variant]
    model = jaxft.from_pretrained(path, dtype="float32")
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, VOCAB, 300), rng.integers(0, VOCAB, 260)
    row = np.concatenate([a, b])[None]
    segment_ids = np.array([[1] * 300 + [2] * 260])
    packed = np.asarray(_packed_forward(model, row, segment_ids))
    # Both documents alone in one batch, b right-padded (a causal model's positions never see what follows).
    alone = np.asarray(_forward(model, np.stack([a, np.pad(b, (0, 40))])))
    alone_a, alone_b = alone[:1], alone[1:, :260]
    assert _rel_err(packed[:, :300], alone_a) <= 1e-5
    assert _rel_err(packed[:, 300:], alone_b) <= 1e-5
    # ...and each document alone is what transformers computes for it.
    assert _rel_err(alone_b, _hf_logits(hf, b[None])) <= 1e-4


def test_explicit_positions_match_transformers_position_ids(saved_models):
    hf, path = saved_models["llama3_untied_gqa"]
    model = jaxft.from_pretrained(path, dtype="float32")
    ids = np.random.default_rng(3).integers(0, VOCAB, size=(1, 520))
    positions = np.arange(520)[None] + 37
    assert _rel_err(np.asarray(_positioned_forward(model, ids, positions)), _hf_logits(hf, ids, positions)) <= 1e-4


@pytest.mark.parametrize("variant", ["llama3_untied_gqa", "llama_yarn_tied", "qwen2_bias_window_layers",
                                     "qwen3_qknorm", "mistral_window"])
def test_export_loads_in_transformers_with_same_logits(saved_models, variant, tmp_path):
    hf, path = saved_models[variant]
    model = jaxft.from_pretrained(path, dtype="float32")
    out = jaxft.save_pretrained(model, tmp_path / "export", max_shard_bytes=40_000)
    assert len(list(out.glob("model-*-of-*.safetensors"))) >= 2  # sharded, with an index
    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                                       dtype=torch.float32,
                                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = np.random.default_rng(4).integers(0, VOCAB, size=(1, SEQ))
    assert _rel_err(_hf_logits(reloaded.eval(), ids), _hf_logits(hf, ids)) <= 1e-6


def test_config_round_trip(saved_models):
    for name, (hf, _) in saved_models.items():
        cfg = ModelConfig.from_hf(hf.config.to_dict())
        again = ModelConfig.from_hf(cfg.to_hf())
        assert again == cfg, name


REAL_SIZES = {
    # name: (config.json essentials, parameter count published for the model)
    "Llama-3.1-8B": (dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                          num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                          max_position_embeddings=131072, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
                     8_030_261_248),
    "Qwen3-8B": (dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                      num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=40960, rope_theta=1000000.0), 8_190_735_360),
    "Mistral-7B": (dict(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        sliding_window=None, max_position_embeddings=32768), 7_248_023_552),
}


@pytest.mark.parametrize("name", list(REAL_SIZES))
def test_real_sizes_build_abstractly(name):
    hf, expected_params = REAL_SIZES[name]
    cfg = ModelConfig.from_hf(hf)
    model = abstract_model(cfg, dtype=jnp.bfloat16)
    leaves = jax.tree.leaves(model)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing allocated
    assert sum(int(np.prod(x.shape)) for x in leaves) == expected_params == cfg.num_params()
    ids = jax.ShapeDtypeStruct((1, 4096), jnp.int32)
    from flax import nnx

    graphdef, state = nnx.split(model)
    logits = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state, ids)
    assert logits.shape == (1, 4096, cfg.vocab_size) and logits.dtype == jnp.bfloat16
