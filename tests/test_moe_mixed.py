"""Qwen3-MoE with dense layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step`) against
transformers' Qwen3MoeForCausalLM and PEFT on tiny random models, fp32, CPU.

Checks: which layers are sparse equals transformers' decision; logits equal transformers' at 512 tokens for
`mlp_only_layers=[1]` and `decoder_sparse_step=2`; the program scans runs of one kind (or periods) with one
grouped matmul per expert projection per sparse layer of the body; HF -> jaxft -> HF is byte-identical (the
training loss with the router aux term over the sparse layers only, stacked and unstacked:
test_moe_aux_loss); attention + expert `target_parameters` LoRA round-trips through PEFT, and
dense-MLP LoRA exports merged (PEFT has no form for it on this model: see `jaxft.lora.save_adapter`);
greedy generation equals the forward's argmax (stacked and unstacked cache loops). Training: LoRA gradients
through both stacks of a mixed model in test_moe_aux_loss, Qwen3-MoE's `jaxft-train` run with expert LoRA whose
adapter PEFT loads in test_moe_example.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

import jaxft
from jaxft import lora
from jaxft.config import ConfigError, ModelConfig
from jaxft.generation import generate_ids
from jaxft.models.moe import expert_adapters
from jaxft.models.stack import layer_stacks
from jaxft.train.step import split_model, unstack_layers
from lora_helpers import (hf_model_fp32, jax_logits, jaxpr_eqns, perturb_lora_b, rel_err, tiny_qwen3_moe,
                          torch_logits)

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
            tie_word_embeddings=False, norm_topk_prob=True)
MIXED = {"only1": dict(num_hidden_layers=3, mlp_only_layers=[1]), "step2": dict(num_hidden_layers=4, decoder_sparse_step=2)}


def _hf_model(seed: int = 0, **kw):
    return tiny_qwen3_moe({**TINY, **kw}, seed)


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    out = {}
    for name, kw in MIXED.items():
        path = tmp_path_factory.mktemp(f"qwen3_moe_{name}")
        _hf_model(**kw).save_pretrained(path)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, TINY["vocab_size"], (1, 512))


# --------------------------------------------------------------------------- config and parity


@pytest.mark.parametrize("kw", [dict(num_hidden_layers=5, mlp_only_layers=[0, 3]),
                                dict(num_hidden_layers=6, decoder_sparse_step=3),
                                dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])])
def test_sparse_layers_are_the_ones_transformers_builds(kw):
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**TINY, **kw, "hidden_size": 16,
                                                                         "head_dim": 4}))
    theirs = tuple("moe" if isinstance(layer.mlp, transformers.models.qwen3_moe.modeling_qwen3_moe
                                       .Qwen3MoeSparseMoeBlock) else "glu" for layer in hf.model.layers)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    assert cfg.layer_mlps == theirs and "glu" in theirs and "moe" in theirs
    assert ModelConfig.from_hf(cfg.to_hf()).layer_mlps == theirs
    # A config whose dense layers no longer match its keys writes them explicitly.
    out = cfg.replace(layer_mlps=("glu",) + ("moe",) * (cfg.num_layers - 1)).to_hf()
    assert (out["mlp_only_layers"], out["decoder_sparse_step"]) == ([0], 1)


def test_a_config_with_every_layer_dense_is_one_line_naming_the_keys():
    hf = transformers.Qwen3MoeConfig(**TINY, num_hidden_layers=2, mlp_only_layers=[0, 1]).to_dict()
    with pytest.raises(ConfigError, match=r"^cfg.json: mlp_only_layers=\[0, 1\] / decoder_sparse_step=1 make every "
                                          r"layer dense; that is a dense Qwen3 model"):
        ModelConfig.from_hf(hf, source="cfg.json")


@pytest.mark.parametrize("name", list(MIXED))
def test_logits_equal_transformers_at_512_tokens(bases, ids, name):
    model = jaxft.from_pretrained(bases[name], dtype="float32")
    stacks = layer_stacks(model.config)
    assert stacks == ({"layers": (0, 2), "dense_layers": (1,)} if name == "only1" else
                      {"layers": (1, 3), "dense_layers": (0, 2)})
    assert model.dense_layers.mlp.gate_proj.kernel.shape == (len(stacks["dense_layers"]), 64, 96)
    assert model.layers.mlp.gate_up_proj.shape == (2, 4, 64, 64)  # gate's 32 columns, then up's
    assert rel_err(jax_logits(model, ids), torch_logits(hf_model_fp32(bases[name]), ids)) < 1e-5


@pytest.mark.parametrize("name, scans", [("only1", [1, 1, 1]), ("step2", [2])])
def test_program_scans_runs_of_one_kind_or_whole_periods(bases, ids, name, scans):
    """mlp_only_layers=[1]: sparse, dense, sparse = three runs; decoder_sparse_step=2: (dense, sparse) is one
    period, scanned twice. Either way 2 grouped matmuls (gate+up, down) per sparse layer in a body and no host sync."""
    model = jaxft.from_pretrained(bases[name], dtype="float32")
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, jnp.asarray(ids)).jaxpr
    top = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in top] == scans
    per_body = [[e.primitive.name for e in jaxpr_eqns(s.params["jaxpr"].jaxpr)].count("ragged_dot_general")
                for s in top]
    assert per_body == ([2, 0, 2] if name == "only1" else [2])  # gate+up, down per sparse layer
    assert not [e for e in jaxpr_eqns(jaxpr)
                if "callback" in e.primitive.name or e.primitive.name in ("while", "cond")]


# --------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("name", list(MIXED))
def test_hf_round_trip_is_byte_identical(bases, tmp_path, name):
    src = load_file(bases[name] / "model.safetensors")
    assert "model.layers.1.mlp.gate_proj.weight" in src or "model.layers.0.mlp.gate_proj.weight" in src
    out = jaxft.save_pretrained(jaxft.from_pretrained(bases[name], dtype="float32"), tmp_path / "out")
    dst = load_file(out / "model.safetensors")
    assert sorted(src) == sorted(dst)
    for key in src:
        assert src[key].shape == dst[key].shape and src[key].tobytes() == dst[key].tobytes(), key
    written = json.loads((out / "config.json").read_text())
    source = json.loads((bases[name] / "config.json").read_text())
    assert (written["mlp_only_layers"], written["decoder_sparse_step"]) == (source["mlp_only_layers"],
                                                                            source["decoder_sparse_step"])


# --------------------------------------------------------------------------- LoRA through PEFT


EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def test_attention_and_expert_lora_round_trip_through_peft(bases, ids, tmp_path):
    base = bases["only1"]
    model = lora.apply_lora(jaxft.from_pretrained(base, dtype="float32"),
                            lora.LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"],
                                            target_parameters=EXPERTS, rank_pattern={"model.layers.1.self_attn.v_proj": 2}))
    names = lora.target_names(model, model.lora_config)
    assert {n for n in names if ".mlp." in n} == {f"model.layers.{i}.mlp.{p}" for i in (0, 2) for p in EXPERTS}
    assert {n for n in names if "q_proj" in n} == {f"model.layers.{i}.self_attn.q_proj" for i in range(3)}
    perturb_lora_b(model, seed=2)
    ours = jax_logits(model, ids)
    assert rel_err(ours, torch_logits(hf_model_fp32(base), ids)) > 1e-2, "the adapter must change the logits"
    out = lora.save_adapter(model, tmp_path / "ours")
    tensors = load_file(out / "adapter_model.safetensors")
    assert tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].shape == (32, 2)
    assert not [k for k in tensors if "layers.1.mlp" in k]
    reference = peft.PeftModel.from_pretrained(hf_model_fp32(base), out).eval()
    assert rel_err(torch_logits(reference, ids), ours) < 1e-5

    # PEFT's own file (B perturbed again on its side) back into jaxft.
    with torch.no_grad():
        gen = torch.Generator().manual_seed(7)
        for name, p in reference.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    reference.save_pretrained(tmp_path / "peft")
    expected = torch_logits(reference, ids)
    back = lora.load_adapter(jaxft.from_pretrained(base, dtype="float32"), tmp_path / "peft")
    assert len(expert_adapters(back)) == 2 and back.dense_layers.attn.v_proj.has_lora
    assert rel_err(jax_logits(back, ids), expected) < 1e-5


def test_dense_mlp_lora_exports_merged_and_has_no_peft_form(bases, ids, tmp_path):
    """LoRA on every linear (all-linear: the dense layers' gate/up/down too) and the experts; the merged export
    loads in transformers with our logits. PEFT reads gate_proj/up_proj/down_proj targets of a Qwen3-MoE model as
    the experts, so an adapter file is refused with the reason."""
    base = bases["step2"]
    model = lora.apply_lora(jaxft.from_pretrained(base, dtype="float32"),
                            lora.LoraConfig(r=4, alpha=8, target_modules="all-linear", target_parameters=EXPERTS))
    names = lora.target_names(model, model.lora_config)
    assert {n for n in names if ".mlp." in n and "experts" not in n} == {
        f"model.layers.{i}.mlp.{p}_proj" for i in (0, 2) for p in ("gate", "up", "down")}
    perturb_lora_b(model, seed=4)
    ours = jax_logits(model, ids)
    assert rel_err(ours, torch_logits(hf_model_fp32(base), ids)) > 1e-2
    out = jaxft.save_pretrained(model, tmp_path / "merged")
    assert rel_err(torch_logits(hf_model_fp32(out), ids), ours) < 1e-5
    model.dense_layers.mlp.down_proj.lora_b[...] = jnp.zeros_like(model.dense_layers.mlp.down_proj.lora_b[...])
    assert rel_err(jax_logits(model, ids), ours) > 1e-3, "the dense MLP's adapter must matter"
    with pytest.raises(ValueError, match=r"^save_adapter: LoRA on the dense layers' MLP \(model.layers.0.mlp.gate_proj,"
                                         r" \.\.\.\) of this qwen3_moe model has no PEFT form"):
        lora.save_adapter(model, tmp_path / "adapter")


# --------------------------------------------------------------------------- generation and training


@pytest.mark.slow
def test_greedy_generation_equals_the_forward_argmax(bases):
    model = lora.apply_lora(jaxft.from_pretrained(bases["step2"], dtype="float32"),
                            lora.LoraConfig(r=2, target_modules=["q_proj", "gate_proj"]))
    perturb_lora_b(model, seed=3)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, TINY["vocab_size"], n).tolist() for n in (70, 17)]
    new = 4
    got = generate_ids(model, prompts, max_new_tokens=new, stop_token_ids=[])
    # Both continuations in one forward (one compile): the shorter row padded at its end, which a causal model's
    # earlier positions never see.
    rows = [prompt + tokens for prompt, tokens in zip(prompts, got)]
    width = max(map(len, rows))
    logits = jax_logits(model, np.asarray([row + [0] * (width - len(row)) for row in rows]))
    for prompt, tokens, row_logits in zip(prompts, got, logits):
        assert len(tokens) == new
        assert tokens == row_logits[len(prompt) - 1:len(prompt) + new - 1].argmax(-1).tolist()
    graphdef, params, frozen = split_model(model)
    unstacked = nnx.merge(graphdef, params, unstack_layers(frozen))
    assert generate_ids(unstacked, prompts, max_new_tokens=new, stop_token_ids=[]) == got
