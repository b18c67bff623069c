"""Gemma 2 and 3 on the GPU: the bf16 LoRA training step with the Pallas flash kernel (attention softcap,
per-layer windows, packed rows) and the fused linear cross-entropy (final softcap) matches the fp32 XLA
reference in loss and LoRA gradients, and the flash kernels are in the compiled step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpu_helpers import compile_fast

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")

SEQ = 512
# head_dim 64 and hidden 256: kernel-friendly tiles at a compile time of seconds; windows (128) shorter
# than the documents so the band bites; softcaps low enough that tanh saturates on some scores.
BASE = dict(vocab_size=512, hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6, query_pre_attn_scalar=64,
            sliding_window=128, pad_token_id=0, eos_token_id=1, bos_token_id=2)
CONFIGS = {
    "gemma2": dict(num_hidden_layers=2, attn_logit_softcapping=5.0, final_logit_softcapping=5.0),
    "gemma3_text": dict(
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}}),
}


def _saved_model(kind, path):
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(kind, **{**BASE, **CONFIGS[kind]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
            elif "embed_tokens" in name or "q_proj" in name or "k_proj" in name:
                p.normal_(0.0, 0.2)  # large scores and logits: both softcaps bite
    model.save_pretrained(path)
    return path


def _loss_and_grads(path, dtype, execution, batch):
    from flax import nnx

    import jaxft
    from jaxft import lora
    from jaxft.train.step import token_loss_sum
    from lora_helpers import perturb_lora_b

    model = lora.apply_lora(jaxft.from_pretrained(path, dtype=dtype),
                            lora.LoraConfig(r=8, alpha=16, target_modules="all-linear"))
    perturb_lora_b(model)
    graphdef, params, rest = nnx.split(model, lora.trainable_filter, ...)

    def loss_fn(p, batch):
        return token_loss_sum(nnx.merge(graphdef, p, rest), batch, execution=execution) / batch["loss_mask"].sum()

    step = compile_fast(jax.value_and_grad(loss_fn), params, batch)
    loss, grads = step(params, batch)
    return float(loss), [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)], step.as_text()


@needs_gpu
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_gemma_bf16_pallas_step_matches_fp32_reference(kind, tmp_path):
    from jaxft.memory.execution import ExecutionConfig
    from kernels_pallas.attention.flash import DKDV_NAME, DQ_NAME, FWD_NAME
    from lora_helpers import rel_err

    path = _saved_model(kind, tmp_path / kind)
    rng = np.random.default_rng(0)
    lengths = [150, 250, 1 + SEQ - 400]  # three documents, each longer than the window
    ids = rng.integers(3, BASE["vocab_size"], (1, SEQ + 1))
    seg = np.repeat(np.arange(1, 4), lengths)[None, :SEQ + 1].astype(np.int32)
    batch = dict(input_ids=jnp.asarray(ids[:, :-1]), targets=jnp.asarray(ids[:, 1:]),
                 loss_mask=jnp.asarray((seg[:, 1:] == seg[:, :-1]).astype(np.float32)),
                 segment_ids=jnp.asarray(seg[:, :-1]), positions=None)
    fast = ExecutionConfig(attention_implementation="pallas", remat="none")
    exact = ExecutionConfig(attention_implementation="reference", remat="none")
    loss, grads, hlo = _loss_and_grads(path, "bfloat16", fast, batch)
    want_loss, want_grads, _ = _loss_and_grads(path, "float32", exact, batch)
    assert loss == pytest.approx(want_loss, rel=2e-2)
    for g, w in zip(grads, want_grads):
        assert rel_err(g, w) < 8e-2  # bf16 weights and activations against fp32 throughout
    for name in (FWD_NAME, DQ_NAME, DKDV_NAME):
        assert name in hlo, name
