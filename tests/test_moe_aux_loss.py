"""The router load-balancing loss of Qwen3-MoE against transformers' `outputs.loss` (CE + coef * aux), fp32, CPU.

transformers computes aux over a padded batch with its 2-D attention mask (padding excluded from the counts,
the probability sums and the row count); jaxft computes it over packed rows with padding = segment id 0. The
same documents therefore give the same loss: transformers on a [3, 400] right-padded batch, jaxft's training
step on the documents packed into 2 x 512 rows. With the aux term the model mixes dense and sparse layers
(`mlp_only_layers`), whose dense layers take no part in it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import jaxft
from jaxft import lora
from jaxft.config import ConfigError, ModelConfig
from jaxft.train.step import loss_and_grad_sums, make_eval_step, split_model, unstack_layers
from lora_helpers import rel_err

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            max_position_embeddings=1024, tie_word_embeddings=False, norm_topk_prob=True)
LENGTHS = (300, 212, 400)
COEF = 0.5  # large, so that a wrong aux term shows in the total


def _base(tmp_path, output_router_logits: bool, **overrides):
    config = transformers.Qwen3MoeConfig(**{**TINY, **overrides}, output_router_logits=output_router_logits,
                                         router_aux_loss_coef=COEF)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)  # unbalanced routing: aux well above its minimum k
    model.save_pretrained(tmp_path)
    return model


def _docs():
    rng = np.random.default_rng(1)
    return [rng.integers(0, TINY["vocab_size"], n) for n in LENGTHS]


def _hf_loss(model, docs):
    """transformers' loss on the documents as one right-padded batch (labels -100 and attention mask 0 on padding)."""
    t = max(LENGTHS)
    ids = np.zeros((len(docs), t), np.int64)
    mask = np.zeros((len(docs), t), np.int64)
    for r, d in enumerate(docs):
        ids[r, :len(d)], mask[r, :len(d)] = d, 1
    labels = np.where(mask == 1, ids, -100)
    with torch.no_grad():
        out = model(torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    return float(out.loss), None if out.aux_loss is None else float(out.aux_loss)


def _packed_batch(docs):
    """Docs 0+1 in row 0, doc 2 + padding in row 1 (2 x 512), with jaxft's batch keys and one micro-batch axis."""
    rows = [[0, 1], [2]]
    t = 512
    out = {k: np.zeros((2, t), np.int32) for k in ("input_ids", "targets", "loss_mask", "segment_ids", "positions")}
    for r, members in enumerate(rows):
        pos = 0
        for j, d in enumerate(members, start=1):
            doc = docs[d]
            n = len(doc)
            out["input_ids"][r, pos:pos + n] = doc
            out["targets"][r, pos:pos + n - 1] = doc[1:]
            out["loss_mask"][r, pos:pos + n - 1] = 1
            out["segment_ids"][r, pos:pos + n] = j
            out["positions"][r, pos:pos + n] = np.arange(n)
            pos += n
    return {k: jnp.asarray(v)[None] for k, v in out.items()}


def _first_micro_batch(batch):
    return {k: v[0] for k, v in batch.items()}


@pytest.mark.parametrize("output_router_logits", [True, False])
def test_step_loss_equals_transformers_loss_with_router_aux_on_padded_and_packed_rows(tmp_path, output_router_logits):
    """With the aux term the model is mixed (layer 1 dense, `mlp_only_layers`): the aux term counts the sparse
    layers only, and unstacked frozen weights (the layers unrolled, dense ones passing the router statistics
    through) give the same loss and LoRA gradients."""
    hf = _base(tmp_path, output_router_logits, **({"mlp_only_layers": [1]} if output_router_logits else {}))
    docs = _docs()
    expected, aux = _hf_loss(hf, docs)
    batch = _packed_batch(docs)
    model = lora.apply_lora(jaxft.from_pretrained(tmp_path, dtype="float32"),
                            lora.LoraConfig(r=2, target_modules=["q_proj"]))
    assert model.config.router_aux_loss_coef == (COEF if output_router_logits else None)
    assert model.config.layer_mlps == (("moe", "glu", "moe") if output_router_logits else ("moe",) * 3)
    graphdef, params, frozen = split_model(model)
    step = nnx.jit(loss_and_grad_sums, static_argnums=(0,))
    loss, grads, count = step(graphdef, params, frozen, batch, None)
    assert abs(float(loss / count) - expected) < 1e-5 * abs(expected)
    if not output_router_logits:  # the eval step's loss: with the aux term, below
        return
    eval_sum, eval_count = make_eval_step(graphdef)(params, frozen, _first_micro_batch(batch))
    assert abs(float(eval_sum / eval_count) - expected) < 1e-5 * abs(expected)
    assert COEF * aux > 0.5, "the aux term must be a visible part of the loss"
    loss_u, grads_u, _ = step(graphdef, params, unstack_layers(frozen), batch, None)
    assert abs(float(loss_u) - float(loss)) < 1e-6 * abs(float(loss))
    b_grads = [(g, g_u) for (path, g), g_u in zip(nnx.to_flat_state(grads), jax.tree.leaves(grads_u))
               if path[-1] == "lora_b"]
    assert len(b_grads) == 2  # q_proj in both stacks; A's gradients are 0 while B is 0
    for g, g_u in b_grads:
        assert np.abs(np.asarray(g[...])).max() > 0 and rel_err(g_u, g[...]) < 1e-5


def test_router_aux_config_round_trips_and_bad_coefficients_are_refused():
    hf = transformers.Qwen3MoeConfig(**TINY, output_router_logits=True, router_aux_loss_coef=0.01).to_dict()
    cfg = ModelConfig.from_hf(hf)
    assert cfg.router_aux_loss_coef == 0.01
    out = cfg.to_hf()
    assert out["output_router_logits"] is True and out["router_aux_loss_coef"] == 0.01
    off = ModelConfig.from_hf({**hf, "output_router_logits": False})
    assert off.router_aux_loss_coef is None and off.to_hf()["output_router_logits"] is False
    with pytest.raises(ConfigError, match=r"cfg.json: router_aux_loss_coef='x' must be a finite number >= 0"):
        ModelConfig.from_hf({**hf, "router_aux_loss_coef": "x"}, source="cfg.json")
