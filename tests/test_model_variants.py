"""Execution variants of one model give one answer: attention implementations (the Pallas kernels in interpret mode
on CPU vs the XLA reference), logits and LoRA gradients through the model's own loss (`token_loss_sum`).
Rematerialisation policies' gradients: tests/test_remat.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxft.config import ModelConfig
from jaxft.memory.execution import ExecutionConfig
from jaxft.lora import LoraConfig, apply_lora
from jaxft.models import init_model
from jaxft.train.step import split_model, token_loss_sum

CFG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=64)


def _batch(b=2, t=128, seed=0):
    rng = np.random.default_rng(seed)
    seg = np.repeat([[1] * 50 + [2] * 60 + [0] * (t - 110)], b, 0).astype(np.int32)
    ids = rng.integers(0, CFG.vocab_size, (b, t)).astype(np.int32)
    pos = np.concatenate([np.arange(50), np.arange(60), np.arange(t - 110)])[None].repeat(b, 0).astype(np.int32)
    targets = np.roll(ids, -1, axis=1)
    mask = ((seg > 0) & (np.roll(seg, -1, axis=1) == seg)).astype(np.float32)
    mask[:, -1] = 0
    return {k: jnp.asarray(v) for k, v in dict(input_ids=ids, targets=targets, loss_mask=mask, segment_ids=seg,
                                                positions=pos).items()}


def _lora_model():
    model = init_model(CFG, dtype=jnp.float32, seed=1)
    model = apply_lora(model, LoraConfig(r=4, alpha=8), seed=2)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):  # B != 0, or the grads of A are all zero
        if var[...].ndim == 3 and var[...].shape[1] == 4:
            var[...] = jax.random.normal(jax.random.key(3), var[...].shape) * 0.1
    return model


def _loss_and_grads(model, batch, **execution):
    graphdef, lora, frozen = split_model(model)
    execution = ExecutionConfig(**{"attention_implementation": "reference", **execution})

    def loss(lora):
        return token_loss_sum(nnx.merge(graphdef, lora, frozen), batch, execution=execution)

    return jax.jit(jax.value_and_grad(loss))(lora)


def test_pallas_attention_model_matches_xla_on_packed_rows():
    batch = _batch(t=256)
    model = _lora_model()
    args = (batch["input_ids"], batch["positions"], batch["segment_ids"])
    pallas = ExecutionConfig(attention_implementation="pallas")
    # jitted: one program per forward (op by op, every eager op and interpreted kernel call compiles on its own)
    forward = lambda execution: nnx.jit(lambda m, *a: m(*a, execution=execution))(model, *args)  # noqa: E731
    np.testing.assert_allclose(np.asarray(forward(pallas)), np.asarray(forward(ExecutionConfig())),
                               rtol=2e-4, atol=2e-4)
    want_loss, want = _loss_and_grads(model, batch, remat="none")
    got_loss, got = _loss_and_grads(model, batch, attention_implementation="pallas")
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4 * float(jnp.max(jnp.abs(w))))
