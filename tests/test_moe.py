"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM (and PEFT) on tiny random models, fp32, CPU.

Checks: logits equal transformers' at 2 x 512 tokens with norm_topk_prob on and off; the MoE block's
gradients (input, router, experts) equal torch autograd through transformers' sparse block; HF -> jaxft ->
HF is byte-identical; packed rows equal each document alone; the compiled forward has one grouped matmul per
expert projection in the layer body, no host callback and no loop but the layer scan. (Mixed dense/sparse stacks,
and this family's attention + expert LoRA through PEFT both ways and its merged export: tests/test_moe_mixed.py;
expert LoRA: tests/test_moe_lora.py.)
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

import jaxft
from jaxft.config import ConfigError, ModelConfig
from lora_helpers import hf_model_fp32, jax_logits, jaxpr_eqns, rel_err, tiny_qwen3_moe, torch_logits

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            max_position_embeddings=1024, tie_word_embeddings=False)


def _hf_model(norm_topk_prob: bool, seed: int = 0):
    return tiny_qwen3_moe({**TINY, "norm_topk_prob": norm_topk_prob}, seed)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    out = {}
    for norm in (False, True):
        path = tmp_path_factory.mktemp(f"qwen3_moe_norm{int(norm)}")
        _hf_model(norm).save_pretrained(path)
        out[norm] = path
    return out


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, 512))







# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_logits_equal_transformers_at_512_tokens(bases, ids, norm_topk_prob):
    model = jaxft.from_pretrained(bases[norm_topk_prob], dtype="float32")
    assert model.config.num_experts == 8 and model.config.norm_topk_prob is norm_topk_prob
    expected = torch_logits(hf_model_fp32(bases[norm_topk_prob]), ids)
    assert rel_err(jax_logits(model, ids), expected) < 1e-5


def test_moe_block_gradients_equal_torch_autograd(bases):
    """The sparse block alone: output and d(input), d(router), d(experts) against transformers' block."""
    hf = hf_model_fp32(bases[True])
    block = hf.model.layers[1].mlp
    mlp = jaxft.from_pretrained(bases[True], dtype="float32").layers.mlp
    layer = jax.tree.map(lambda a: a[1], nnx.state(mlp))  # layer 1's slice of the stacked parameters
    rng = np.random.default_rng(3)
    x = rng.normal(0.0, 1.0, (2, 64, TINY["hidden_size"])).astype(np.float32)
    dy = rng.normal(0.0, 1.0, x.shape).astype(np.float32)

    xt = torch.tensor(x, requires_grad=True)
    yt = block(xt)
    (yt * torch.tensor(dy)).sum().backward()

    graphdef = nnx.graphdef(mlp)

    def f(state, x):
        return nnx.merge(graphdef, state)(x)

    y, vjp = jax.vjp(f, layer, jnp.asarray(x))
    d_state, dx = vjp(jnp.asarray(dy))
    assert rel_err(y, yt.detach().numpy()) < 1e-5
    assert rel_err(dx, xt.grad.numpy()) < 1e-5
    assert rel_err(d_state["router"][...], block.gate.weight.grad.numpy().T) < 1e-5
    gate_up = block.experts.gate_up_proj.grad.numpy()  # [E, 2I, H]: gate rows, then up rows, as our columns
    assert rel_err(d_state["gate_up_proj"][...], gate_up.transpose(0, 2, 1)) < 1e-5
    assert rel_err(d_state["down_proj"][...], block.experts.down_proj.grad.numpy().transpose(0, 2, 1)) < 1e-5


# --------------------------------------------------------------------------- checkpoints


def test_hf_round_trip_is_byte_identical_with_per_expert_tensors(bases, tmp_path):
    src = load_file(bases[False] / "model.safetensors")
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in src and "model.layers.0.mlp.gate.weight" in src
    out = jaxft.save_pretrained(jaxft.from_pretrained(bases[False], dtype="float32"), tmp_path / "out")
    dst = load_file(out / "model.safetensors")
    assert sorted(src) == sorted(dst)
    for name in src:
        assert src[name].shape == dst[name].shape and src[name].tobytes() == dst[name].tobytes(), name
    written = json.loads((out / "config.json").read_text())
    assert written["num_local_experts"] == 8 and "num_experts" not in written  # the source's spelling kept


# --------------------------------------------------------------------------- packing and program


def test_packed_rows_equal_each_document_alone(bases):
    model = jaxft.from_pretrained(bases[True], dtype="float32")
    rng = np.random.default_rng(4)
    lengths = (200, 57, 255)
    docs = [rng.integers(0, TINY["vocab_size"], (1, n)) for n in lengths]
    packed = np.concatenate(docs, axis=1)
    segments = np.concatenate([np.full((1, n), k + 1) for k, n in enumerate(lengths)], axis=1)
    got = jax_logits(model, packed, segment_ids=jnp.asarray(segments))
    # Each document alone, as one row of a batch right-padded to the longest (one compile): a causal model's
    # positions never see the padding after them, and routing is per token (no expert capacity).
    alone = jax_logits(model, np.stack([np.pad(d[0], (0, max(lengths) - d.shape[1])) for d in docs]))
    start = 0
    for row, doc in enumerate(docs):
        n = doc.shape[1]
        np.testing.assert_allclose(got[:, start:start + n], alone[row:row + 1, :n], rtol=1e-5, atol=1e-5)
        start += n


def test_forward_program_has_one_grouped_matmul_per_projection_and_no_host_sync(bases, ids):
    model = jaxft.from_pretrained(bases[False], dtype="float32")
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, jnp.asarray(ids)).jaxpr
    names = [e.primitive.name for e in jaxpr_eqns(jaxpr)]
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == TINY["num_hidden_layers"]
    body = [e.primitive.name for e in jaxpr_eqns(scans[0].params["jaxpr"].jaxpr)]
    assert body.count("ragged_dot_general") == 2  # gate and up together, down: whatever the number of experts
    assert names.count("ragged_dot_general") == 2  # and none outside the layer body
    assert not [n for n in names if "callback" in n or n in ("while", "cond")], sorted(set(names))
    assert names.count("scan") == 1  # no loop over experts


# --------------------------------------------------------------------------- config


def test_config_round_trips_and_bad_expert_counts_are_refused():
    hf = transformers.Qwen3MoeConfig(**TINY, norm_topk_prob=True).to_dict()
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    again = transformers.Qwen3MoeConfig(**{k: v for k, v in cfg.to_hf().items() if k != "model_type"})
    assert (again.num_experts, again.num_experts_per_tok, again.norm_topk_prob) == (8, 2, True)
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(9\) must be at most num_experts \(8\)"):
        ModelConfig.from_hf({**hf, "num_experts_per_tok": 9})
