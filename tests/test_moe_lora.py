"""Expert LoRA on Qwen3-MoE against PEFT's `target_parameters` (ParamWrapper) on tiny random models, fp32, CPU.

Checks: an adapter jaxft exports gives PEFT (transformers Qwen3MoeForCausalLM + the adapter) jaxft's logits at
512 tokens; an adapter PEFT saves imports into jaxft with PEFT's logits; PEFT's delta weight of every expert
equals jaxft's merged kernels and jaxft's grouped-matmul forward on that expert; the expert factors' gradients
equal torch autograd through PEFT; a merged export loads in transformers; bad names and dropout are refused.
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
from bridge import peft as peft_io
from jaxft import lora
from jaxft.config import ConfigError
from jaxft.models.moe import expert_adapters
from lora_helpers import (hf_model_fp32, jax_logits, param_wrappers, perturb_lora_b, rel_err, tiny_qwen3_moe,
                          torch_logits)

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=1024, tie_word_embeddings=False, norm_topk_prob=True)
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
FIELDS = dict(r=4, alpha=8, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj", "experts.down_proj"],
              rank_pattern={"down_proj": 2})


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    model = tiny_qwen3_moe(TINY)
    path = tmp_path_factory.mktemp("qwen3_moe_lora")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, TINY["vocab_size"], (1, 512))





def _adapted(base, seed=2):
    model = lora.apply_lora(jaxft.from_pretrained(base, dtype="float32"), lora.LoraConfig(**FIELDS))
    perturb_lora_b(model, seed=seed)
    return model


def test_exported_expert_adapter_gives_peft_our_logits_at_512_tokens(base, ids, tmp_path):
    model = _adapted(base)
    assert {p for p, _ in expert_adapters(model)} == {"layers.mlp.gate_up_lora", "layers.mlp.down_lora"}
    ours = jax_logits(model, ids)
    assert rel_err(ours, torch_logits(hf_model_fp32(base), ids)) > 1e-2, "the adapter must change the logits"
    out = lora.save_adapter(model, tmp_path / "ours")
    tensors = load_file(out / "adapter_model.safetensors")
    # PEFT nests one wrapper per parameter in module order: gate_up_proj inside, down_proj outside.
    gate_up = tensors["base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"]
    down_b = tensors["base_model.model.model.layers.1.mlp.experts.lora_B.weight"]
    assert gate_up.shape == (4 * 4, 64) and down_b.shape == (64, 2 * 4)
    written = json.loads((out / "adapter_config.json").read_text())
    assert written["target_parameters"] == sorted(FIELDS["target_parameters"])
    reference = peft.PeftModel.from_pretrained(hf_model_fp32(base), out).eval()
    assert set(param_wrappers(reference)) == {f"model.layers.{i}.{p}" for i in range(2) for p in EXPERTS}
    assert rel_err(torch_logits(reference, ids), ours) < 1e-5
    for _, adapter in expert_adapters(model):  # the experts' share of the change is not negligible
        adapter.lora_b[...] = jnp.zeros_like(adapter.lora_b[...])
    assert rel_err(jax_logits(model, ids), ours) > 1e-3


def _peft_model(base, seed=5):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS,
                             rank_pattern={"down_proj": 2}, task_type="CAUSAL_LM")
    model = peft.get_peft_model(hf_model_fp32(base), config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def test_peft_saved_expert_adapter_imports_with_peft_logits(base, ids, tmp_path):
    reference = _peft_model(base)
    reference.save_pretrained(tmp_path / "peft")
    expected = torch_logits(reference, ids)
    assert rel_err(expected, torch_logits(hf_model_fp32(base), ids)) > 1e-2
    model = lora.load_adapter(jaxft.from_pretrained(base, dtype="float32"), tmp_path / "peft")
    assert model.lora_config.target_parameters == ("mlp.experts.down_proj", "mlp.experts.gate_up_proj")
    assert rel_err(jax_logits(model, ids), expected) < 1e-5


def test_peft_delta_weight_equals_ours_on_every_expert(base, tmp_path):
    """PEFT's merged delta [E, out, in] per expert against jaxft's merged kernels and jaxft's forward (the
    grouped matmuls of ExpertLora, every row routed to that expert)."""
    model = _adapted(base, seed=3)
    lora.save_adapter(model, tmp_path / "ours")
    wrappers = param_wrappers(peft.PeftModel.from_pretrained(hf_model_fp32(base), tmp_path / "ours"))
    plain = jaxft.from_pretrained(base, dtype="float32").layers.mlp
    merged = lora.merged_kernels(model)
    mlp = model.layers.mlp
    i, e = TINY["moe_intermediate_size"], TINY["num_experts"]
    x = np.random.default_rng(7).normal(size=(6, 64)).astype(np.float32)
    for layer in range(TINY["num_hidden_layers"]):
        with torch.no_grad():
            gu = wrappers[f"model.layers.{layer}.mlp.experts.gate_up_proj"].get_delta_weight("default").numpy()
            dn = wrappers[f"model.layers.{layer}.mlp.experts.down_proj"].get_delta_weight("default").numpy()
        assert gu.shape == (e, 2 * i, 64) and dn.shape == (e, 64, i)  # the module's [E, out, in] layout
        for key, want in ((("layers", "mlp", "gate_up_proj"), gu), (("layers", "mlp", "down_proj"), dn)):
            got = np.asarray(merged[key][layer]) - np.asarray(getattr(plain, key[-1])[...][layer])
            assert rel_err(got, want.transpose(0, 2, 1)) < 1e-5, key
        for slot, delta in (("gate_up_lora", gu), ("down_lora", dn)):
            adapter = nnx.merge(*nnx.split(getattr(mlp, slot)))
            one = jax.tree.map(lambda v: v[layer], nnx.state(adapter))
            layer_adapter = nnx.merge(nnx.graphdef(adapter), one)
            rows = x[:, :delta.shape[2]]
            for expert in range(e):
                sizes = jnp.zeros((e,), jnp.int32).at[expert].set(len(rows))
                got = np.asarray(layer_adapter.delta(jnp.asarray(rows), sizes))
                assert rel_err(got, rows @ delta[expert].T) < 1e-5, (slot, layer, expert)


def test_expert_lora_gradients_equal_torch_autograd_through_peft(base, tmp_path):
    model = _adapted(base, seed=4)
    lora.save_adapter(model, tmp_path / "ours")
    reference = peft.PeftModel.from_pretrained(hf_model_fp32(base), tmp_path / "ours", is_trainable=True)
    rng = np.random.default_rng(8)
    ids = rng.integers(0, TINY["vocab_size"], (1, 128))
    dy = rng.normal(size=(1, 128, TINY["vocab_size"])).astype(np.float32)
    (reference(torch.tensor(ids)).logits * torch.tensor(dy)).sum().backward()
    torch_grads = {n: p.grad.numpy() for n, p in reference.named_parameters() if p.grad is not None}

    graphdef, params, rest = nnx.split(model, lora.trainable_filter, ...)

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params, rest)(jnp.asarray(ids)) * dy)

    grads = nnx.merge(graphdef, jax.grad(loss)(params), rest).layers.mlp
    for slot, param in (("gate_up_lora", "gate_up_proj"), ("down_lora", "down_proj")):
        g = getattr(grads, slot)
        rank = 4 if slot == "gate_up_lora" else 2
        for layer in range(TINY["num_hidden_layers"]):
            key = peft_io.param_wrapper_keys([f"model.layers.{layer}.mlp.experts.{p}"
                                              for p in ("gate_up_proj", "down_proj")])[
                f"model.layers.{layer}.mlp.experts.{param}"]
            ga, gb = peft_io.pack_experts(np.asarray(g.lora_a[...][layer])[..., :rank],
                                          np.asarray(g.lora_b[...][layer])[..., :rank, :])
            want_a = torch_grads[f"base_model.model.{key}.lora_A.default.weight"]
            want_b = torch_grads[f"base_model.model.{key}.lora_B.default.weight"]
            assert np.abs(want_a).max() > 0 and np.abs(want_b).max() > 0
            assert rel_err(ga, want_a) < 1e-4, (slot, layer)
            assert rel_err(gb, want_b) < 1e-4, (slot, layer)


def test_merged_export_with_expert_lora_loads_in_transformers(base, ids, tmp_path):
    model = _adapted(base, seed=6)
    ours = jax_logits(model, ids)
    out = jaxft.save_pretrained(model, tmp_path / "merged")
    assert rel_err(torch_logits(hf_model_fp32(out), ids), ours) < 1e-5
    merged = lora.merge_lora(model)
    assert not expert_adapters(merged)
    assert rel_err(jax_logits(merged, ids), ours) < 1e-5


def test_bad_expert_targets_are_refused_in_one_line(base):
    model = jaxft.from_pretrained(base, dtype="float32")
    with pytest.raises(ConfigError, match=r"^LoraConfig.target_parameters: 'experts.gate_proj' matches no parameter "
                                          r"of this qwen3_moe model; expert parameters: experts.gate_up_proj, "
                                          r"experts.down_proj \(full names look like "
                                          r"'model.layers.0.mlp.experts.gate_up_proj'\)$"):
        lora.apply_lora(model, lora.LoraConfig(target_parameters=["experts.gate_proj"]))
    with pytest.raises(ConfigError, match=r"LoraConfig.dropout: .* must be 0 with target_parameters"):
        lora.LoraConfig(dropout=0.1, target_parameters=["experts.down_proj"])
    with pytest.raises(ConfigError, match=r"LoraConfig.target_parameters: .* must be None or a list"):
        lora.LoraConfig(target_parameters="experts.down_proj")
    dense = jaxft.models.init_model(jaxft.ModelConfig.from_hf(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2).to_dict()),
        dtype=jnp.float32)
    with pytest.raises(ConfigError, match=r"this llama model has no raw parameters LoRA can target"):
        lora.apply_lora(dense, lora.LoraConfig(target_parameters=["experts.down_proj"]))
