"""Expert LoRA on GPT-OSS against PEFT's `target_parameters` (ParamWrapper on transformers' transposed experts,
[E, in, out]), with attention LoRA beside it, fp32, CPU.

Checks: an adapter jaxft exports (q/k/v/o + experts.gate_up_proj + experts.down_proj, B perturbed) gives PEFT
jaxft's logits at 520 tokens, and PEFT's save of it imports back with the same logits; PEFT's delta weight of every
expert equals jaxft's merged kernels (the fused, interleaved gate/up column for column); an adapter PEFT creates
and saves imports with PEFT's logits; the merged export loads in transformers with our logits.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from safetensors.numpy import load_file

import jaxft
from jaxft import lora
from jaxft.models.moe import expert_adapters
from test_gpt_oss import TINY, gpt_oss_model
from lora_helpers import hf_model_fp32, jax_logits, param_wrappers, perturb_lora_b, rel_err, torch_logits

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
FIELDS = dict(r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
              target_parameters=["experts.gate_up_proj", "experts.down_proj"], rank_pattern={"down_proj": 2})


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_lora")
    gpt_oss_model(seed=2).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, TINY["vocab_size"], (1, 520))


def _adapted(base, seed=2):
    model = lora.apply_lora(jaxft.from_pretrained(base, dtype="float32"), lora.LoraConfig(**FIELDS))
    perturb_lora_b(model, seed=seed)
    return model


def test_exported_adapter_gives_peft_our_logits_and_round_trips(base, ids, tmp_path):
    model = _adapted(base)
    ours = jax_logits(model, ids)
    assert rel_err(ours, torch_logits(hf_model_fp32(base), ids)) > 1e-2, "the adapter must change the logits"
    out = lora.save_adapter(model, tmp_path / "ours")
    tensors = load_file(out / "adapter_model.safetensors")
    e = TINY["num_local_experts"]
    assert tensors["base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"].shape == (64, 4 * e)
    assert tensors["base_model.model.model.layers.1.mlp.experts.lora_A.weight"].shape == (2 * e, 32)
    reference = peft.PeftModel.from_pretrained(hf_model_fp32(base), out).eval()
    assert set(param_wrappers(reference)) == {f"model.layers.{i}.{p}" for i in range(2) for p in EXPERTS}
    assert rel_err(torch_logits(reference, ids), ours) < 1e-5
    reference.save_pretrained(tmp_path / "peft")
    back = lora.load_adapter(jaxft.from_pretrained(base, dtype="float32"), tmp_path / "peft")
    assert rel_err(jax_logits(back, ids), ours) < 1e-5
    for _, adapter in expert_adapters(model):  # the experts' share of the change is not negligible
        adapter.lora_b[...] = jnp.zeros_like(adapter.lora_b[...])
    assert rel_err(jax_logits(model, ids), ours) > 1e-3


def test_peft_delta_weight_equals_ours_on_every_expert(base, tmp_path):
    model = _adapted(base, seed=3)
    lora.save_adapter(model, tmp_path / "ours")
    wrappers = param_wrappers(peft.PeftModel.from_pretrained(hf_model_fp32(base), tmp_path / "ours"))
    plain = jaxft.from_pretrained(base, dtype="float32").layers.mlp
    merged = lora.merged_kernels(model)
    for layer in range(TINY["num_hidden_layers"]):
        for param in ("gate_up_proj", "down_proj"):
            with torch.no_grad():
                want = wrappers[f"model.layers.{layer}.mlp.experts.{param}"].get_delta_weight("default").numpy()
            got = np.asarray(merged[("layers", "mlp", param)][layer]) - np.asarray(getattr(plain, param)[...][layer])
            assert want.shape == got.shape  # [E, in, out]: the transposed experts' own layout
            assert np.abs(want).max() > 0 and rel_err(got, want) < 1e-5, (layer, param)


def test_peft_created_adapter_imports_and_merged_export_loads(base, ids, tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], target_parameters=EXPERTS,
                             task_type="CAUSAL_LM")
    reference = peft.get_peft_model(hf_model_fp32(base), config).eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    reference.save_pretrained(tmp_path / "peft")
    expected = torch_logits(reference, ids)
    model = lora.load_adapter(jaxft.from_pretrained(base, dtype="float32"), tmp_path / "peft")
    ours = jax_logits(model, ids)
    assert rel_err(ours, expected) < 1e-5
    out = jaxft.save_pretrained(model, tmp_path / "merged")
    assert rel_err(torch_logits(hf_model_fp32(out), ids), ours) < 1e-5
