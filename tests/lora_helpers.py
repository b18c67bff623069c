"""Helpers shared by the parity tests (no tests here): relative error, and LoRA B perturbed away from PEFT's
zero init (with B = 0 an adapter changes nothing, so a comparison would prove nothing)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxft.models import linears
from jaxft.models.moe import expert_adapters


def rel_err(a, b) -> float:
    """max |a - b| / max |b|, in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def perturb_lora_b(model, seed: int = 1, std: float = 0.1) -> None:
    """B ~ N(0, std) on the live entries (rows < rank of targeted layers) of every adapter, Linear or expert
    (`ExpertLora`, B [L, E, r, out]); rank padding stays exactly zero."""
    rng = np.random.default_rng(seed)
    adapters = [lin for _, lin in linears(model) if lin.has_lora] + [ad for _, ad in expert_adapters(model)]
    for ad in adapters:
        ranks = np.asarray(ad.lora_rank[...])
        b = rng.normal(0.0, std, ad.lora_b.shape).astype(np.float32)
        live = np.arange(b.shape[-2])[:, None] < ranks.reshape(-1, *[1] * (b.ndim - 1))  # one rank per layer
        ad.lora_b[...] = jax.device_put(b * live)  # no program to compile, as jnp.asarray does


def hf_model_fp32(path):
    """A transformers causal LM from a local directory, fp32, in eval mode (a fresh copy per call)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def torch_logits(model, ids) -> np.ndarray:
    """fp32 numpy logits of a transformers/PEFT model on token ids (no grad)."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


def jax_logits(model, ids, **kw) -> np.ndarray:
    """numpy logits of a jaxft model on token ids, through one jitted call."""
    from flax import nnx

    return np.asarray(nnx.jit(lambda m, x: m(x, **kw))(model, jnp.asarray(ids)))


def param_wrappers(peft_model) -> dict:
    """{full parameter name ("model.layers.0.mlp.experts.down_proj"): PEFT ParamWrapper} of a PeftModel."""
    import peft

    out = {}
    for name, module in peft_model.base_model.model.named_modules():
        if isinstance(module, peft.tuners.lora.ParamWrapper):
            out[name.replace(".base_layer", "") + "." + module.parameter_name] = module
    return out


def jaxpr_eqns(jaxpr):
    """Every equation of a jaxpr, sub-jaxprs (scan/jit/checkpoint bodies) included."""
    import jax.extend

    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from jaxpr_eqns(sub)


def tiny_qwen3_moe(config: dict, seed: int = 0):
    """A random fp32 transformers Qwen3MoeForCausalLM of `config` (Qwen3MoeConfig keys), perturbed so the test
    bites: norms away from 1, decisive routing that spreads tokens over the experts, experts of a useful scale."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config)).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
            elif "experts" in name:
                p.normal_(0.0, 0.1)
    return model
