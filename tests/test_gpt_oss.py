"""GPT-OSS against transformers' GptOssForCausalLM on tiny random models, fp32, CPU.

Checks: logits equal transformers' at 2 x 520 tokens (window 128 < prompt, sinks large enough to matter, yarn
RoPE); the MoE block's output and gradients (input, router + bias, fused interleaved gate/up + bias, down + bias)
equal torch autograd with the SwiGLU clamps active; yarn tables equal transformers' (truncate on and off); HF ->
jaxft -> HF is byte-identical; packed rows (with LoRA) equal each document alone, loss and gradients; the Pallas
flash kernel with sinks and windows gives the reference's logits; greedy generation (KV cache with sinks) equals
transformers'; the compiled forward has one grouped matmul per expert projection and no host sync.
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
from jaxft import lora
from jaxft.config import ConfigError, ModelConfig, RopeConfig
from jaxft.memory.execution import ExecutionConfig
from jaxft.models.rope import inv_freq_and_scale
from jaxft.train.step import token_loss_sum
from lora_helpers import hf_model_fp32, jax_logits, jaxpr_eqns, perturb_lora_b, rel_err, torch_logits

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=1024)
REFERENCE = ExecutionConfig(attention_implementation="reference", remat="none")


def gpt_oss_model(seed: int = 0, **overrides):
    """A tiny random GptOssForCausalLM, fp32, with weights scaled so every feature shows in the logits: norms
    away from 1, decisive routing, sinks of a few units, expert outputs of a few units (clamps reached)."""
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**TINY, **overrides})).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif "router" in name:
                p.normal_(0.0, 0.3)
            elif "sinks" in name:
                p.normal_(0.0, 1.5)
            elif "experts" in name:
                p.normal_(0.0, 0.3 if "gate_up" in name else 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    gpt_oss_model().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, 520))


# --------------------------------------------------------------------------- parity


def test_logits_equal_transformers_at_520_tokens(base, ids):
    model = jaxft.from_pretrained(base, dtype="float32")
    cfg = model.config
    assert cfg.layer_windows == (128, None) and cfg.attention_sinks and cfg.rope.rope_type == "yarn"
    expected = torch_logits(hf_model_fp32(base), ids)
    assert rel_err(jax_logits(model, ids), expected) < 1e-5
    # The sinks are not negligible: without them the logits move.
    model.layers.attn.sinks[...] = jnp.full_like(model.layers.attn.sinks[...], -1e4)
    assert rel_err(jax_logits(model, ids), expected) > 1e-3


def test_moe_block_gradients_equal_torch_autograd_with_clamps_active(base):
    hf = hf_model_fp32(base)
    block = hf.model.layers[1].mlp
    mlp = jaxft.from_pretrained(base, dtype="float32").layers.mlp
    layer = jax.tree.map(lambda a: a[1], nnx.state(mlp))
    rng = np.random.default_rng(3)
    x = rng.normal(0.0, 2.0, (2, 64, TINY["hidden_size"])).astype(np.float32)
    dy = rng.normal(0.0, 1.0, x.shape).astype(np.float32)
    with torch.no_grad():  # the SwiGLU clamps must bite for this test to check them
        gate_up = np.einsum("nh,ehf->enf", x.reshape(-1, x.shape[-1]), block.experts.gate_up_proj.numpy())
    assert (gate_up[..., 0::2] > 7.0).mean() > 0.01 and (np.abs(gate_up[..., 1::2]) > 7.0).mean() > 0.01

    xt = torch.tensor(x, requires_grad=True)
    yt, _ = block(xt)
    (yt * torch.tensor(dy)).sum().backward()
    graphdef = nnx.graphdef(mlp)
    y, vjp = jax.vjp(lambda s, x: nnx.merge(graphdef, s)(x), layer, jnp.asarray(x))
    d_state, dx = vjp(jnp.asarray(dy))
    assert rel_err(y, yt.detach().numpy()) < 1e-5
    assert rel_err(dx, xt.grad.numpy()) < 1e-5
    experts = block.experts
    for ours, theirs in (("router", block.router.weight.grad.numpy().T), ("router_bias", block.router.bias.grad),
                         ("gate_up_proj", experts.gate_up_proj.grad), ("gate_up_bias", experts.gate_up_proj_bias.grad),
                         ("down_proj", experts.down_proj.grad), ("down_bias", experts.down_proj_bias.grad)):
        assert rel_err(d_state[ours][...], np.asarray(theirs)) < 1e-5, ours


def test_router_load_balancing_loss_equals_transformers(base, ids):
    """transformers' aux_loss (softmax over all E of the biased router logits, top-k counts) for GPT-OSS."""
    from jaxft.models.moe import load_balancing_loss

    hf = hf_model_fp32(base)
    with torch.no_grad():
        want = float(hf(torch.tensor(ids), output_router_logits=True).aux_loss)
    model = jaxft.from_pretrained(base, dtype="float32")
    _, stats, rows = nnx.jit(lambda m, x: m.hidden_states_and_router_stats(x))(model, jnp.asarray(ids))
    assert float(load_balancing_loss(stats, rows)) == pytest.approx(want, rel=1e-5)
    assert want > TINY["num_experts_per_tok"] * 1.01  # unbalanced routing: above the minimum k


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_tables_equal_transformers(truncate):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=truncate,
                  original_max_position_embeddings=4096, rope_theta=150000.0)
    config = transformers.GptOssConfig(**{**TINY, "head_dim": 64}, rope_parameters=params)
    inv, scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours, our_scale = inv_freq_and_scale(RopeConfig.from_hf({"rope_parameters": params}), 64, 1024)
    # Equal up to one float32 ulp: torch's vectorised pow and numpy's round base ** (2j / dim) differently.
    np.testing.assert_allclose(ours, inv.numpy(), rtol=2.5e-7, atol=0)
    assert our_scale == pytest.approx(scale, rel=1e-12) and scale == pytest.approx(0.1 * np.log(32) + 1)


def test_hf_round_trip_is_byte_identical(base, tmp_path):
    src = load_file(base / "model.safetensors")
    assert src["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)  # [E, H, 2I], interleaved
    out = jaxft.save_pretrained(jaxft.from_pretrained(base, dtype="float32"), tmp_path / "out")
    dst = load_file(out / "model.safetensors")
    assert sorted(src) == sorted(dst)
    for name in src:
        assert src[name].shape == dst[name].shape and src[name].tobytes() == dst[name].tobytes(), name
    written = json.loads((out / "config.json").read_text())
    again = transformers.GptOssConfig(**{k: v for k, v in written.items() if k != "model_type"})
    source = json.loads((base / "config.json").read_text())
    for key in ("layer_types", "sliding_window", "num_local_experts", "swiglu_limit", "attention_bias", "head_dim"):
        assert getattr(again, key) == source[key], key
    assert again.rope_parameters == source["rope_parameters"]


def test_config_defaults_follow_transformers():
    hf = {k: v for k, v in dict(TINY, model_type="gpt_oss").items() if k != "max_position_embeddings"}
    cfg = ModelConfig.from_hf({**hf, "num_hidden_layers": 3})
    want = transformers.GptOssConfig(**{**TINY, "num_hidden_layers": 3})
    assert cfg.layer_windows == (128, None, 128)
    assert [w is not None for w in cfg.layer_windows] == [t == "sliding_attention" for t in want.layer_types]
    assert (cfg.rope.theta, cfg.rope.factor, cfg.rope.truncate) == (150000.0, 32.0, False)
    assert (cfg.rms_norm_eps, cfg.swiglu_limit, cfg.swiglu_alpha, cfg.qkv_bias, cfg.o_bias) == (1e-5, 7.0, 1.702, True,
                                                                                              True)
    with pytest.raises(ConfigError, match=r"cfg.json: required key 'num_local_experts' is missing"):
        ModelConfig.from_hf({k: v for k, v in hf.items() if k != "num_local_experts"}, source="cfg.json")
    with pytest.raises(ConfigError, match=r"cfg.json: swiglu_limit=-1.0 must be a finite number > 0"):
        ModelConfig.from_hf({**hf, "swiglu_limit": -1.0}, source="cfg.json")


# --------------------------------------------------------------------------- packing, kernels, generation


def test_packed_row_with_lora_equals_each_document_alone(base):
    model = lora.apply_lora(jaxft.from_pretrained(base, dtype="float32"),
                            lora.LoraConfig(r=4, alpha=8, target_modules="all-linear",
                                            target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    perturb_lora_b(model)
    rng = np.random.default_rng(7)
    docs = [rng.integers(0, TINY["vocab_size"], n) for n in (140, 170)]  # both longer than the 128 window
    graphdef, params, rest = nnx.split(model, lora.trainable_filter, ...)

    def batch_of(row, seg):
        keep = (seg[None, 1:] == seg[None, :-1]) & (seg[None, :-1] != 0)  # same document, not padding
        return dict(input_ids=jnp.asarray(row[None, :-1]), targets=jnp.asarray(row[None, 1:]),
                    loss_mask=jnp.asarray(keep.astype(np.float32)), segment_ids=jnp.asarray(seg[None, :-1]),
                    positions=None)

    @jax.jit
    def loss_and_grad(params, batch):
        return jax.value_and_grad(lambda p: token_loss_sum(nnx.merge(graphdef, p, rest), batch,
                                                           execution=REFERENCE))(params)

    t = sum(len(d) for d in docs)
    packed = batch_of(np.concatenate(docs), np.repeat([1, 2], [len(d) for d in docs]).astype(np.int32))
    # Each document alone in a row of the same length (one compiled step), right-padded with segment 0.
    alone = [batch_of(np.pad(d, (0, t - len(d))), np.pad(np.ones(len(d), np.int32), (0, t - len(d))))
             for d in docs]
    l_packed, g_packed = loss_and_grad(params, packed)
    parts = [loss_and_grad(params, b) for b in alone]
    assert float(l_packed) == pytest.approx(sum(float(l) for l, _ in parts), rel=1e-5)
    leaves = jax.tree.leaves(g_packed)
    assert len(leaves) == 12  # q/k/v/o A and B, and the two expert adapters' A and B
    for a, b, c in zip(leaves, *(jax.tree.leaves(g) for _, g in parts)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b + c), rtol=1e-4, atol=1e-5 * float(jnp.abs(a).max()))


def test_sinks_go_to_cudnn_only_on_dense_rows():
    """`auto` sends a GPT-OSS layer's dense rows (full or windowed) to cuDNN with the sink correction
    (kernels_pallas/attention/sinks.py) and its packed rows to the Pallas kernel, at every measured length;
    asking cuDNN by name for sinks on packed rows is refused in one line instead of silently dropping them."""
    from kernels_pallas.attention.config import choose_implementation
    from kernels_pallas.attention.cudnn import cudnn_attention

    for t in (512, 4096, 32768):
        for window in (None, 128):
            for packed in (False, True):
                kw = dict(causal=True, sliding_window=window, logit_softcap=None, scale=0.125, backend="gpu")
                assert choose_implementation((1, t, 64, 64), (1, t, 8, 64), jnp.bfloat16, packed,
                                             sinks=jnp.zeros(64), **kw) == ("pallas" if packed else "cudnn")
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"cuDNN attention supports neither logit_softcap nor sinks on packed "
                                         r"rows; use implementation='pallas' or 'reference'"):
        cudnn_attention(q, q, q, sinks=jnp.zeros((2,)), segment_ids=jnp.ones((1, 8), jnp.int32))


def test_greedy_generation_matches_transformers(base):
    from jaxft.generation import generate_ids

    hf = hf_model_fp32(base)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, TINY["vocab_size"], n).tolist() for n in (5, 140)]  # the second crosses the window
    got = generate_ids(jaxft.from_pretrained(base, dtype="float32"), prompts, max_new_tokens=8)
    for prompt, row in zip(prompts, got):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=8)
        assert row == out[0, len(prompt):].tolist()


def test_forward_program_has_one_grouped_matmul_per_projection_and_no_host_sync(base, ids):
    model = jaxft.from_pretrained(base, dtype="float32")
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, jnp.asarray(ids)).jaxpr
    names = [e.primitive.name for e in jaxpr_eqns(jaxpr)]
    # One scan per layer kind (sliding, full); in each layer one grouped matmul for the fused gate/up, one for down.
    assert names.count("scan") == 2
    assert names.count("ragged_dot_general") == 2 * TINY["num_hidden_layers"]
    assert not [n for n in names if "callback" in n or n in ("while", "cond")], sorted(set(names))


@pytest.mark.gpu
def test_gpu_pallas_attention_with_sinks_gradients_match_reference():
    """On the GPU (compiled Pallas kernels, not interpret mode): a GPT-OSS model's logits and the gradients of its
    sinks and q projection through the flash forward/backward with sinks and a window equal the reference's."""
    from gpu_helpers import compile_fast
    from jaxft.models import init_model

    hf = dict(TINY, model_type="gpt_oss", head_dim=64, num_attention_heads=4, num_key_value_heads=2, sliding_window=40)
    model = init_model(ModelConfig.from_hf(hf), dtype=jnp.float32, seed=0)
    model.layers.attn.sinks[...] = jnp.asarray(np.random.default_rng(2).normal(0.0, 2.0, (2, 4)), jnp.float32)
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(0, TINY["vocab_size"], (2, 256)))
    seg = jnp.asarray(np.repeat([1, 2], [90, 166])[None].repeat(2, 0).astype(np.int32))
    dy = jnp.asarray(rng.normal(size=(2, 256, TINY["vocab_size"])).astype(np.float32))
    graphdef, state = nnx.split(model)

    def grads(impl):
        execution = ExecutionConfig(attention_implementation=impl, remat="none")
        loss = lambda s: jnp.sum(nnx.merge(graphdef, s)(ids, segment_ids=seg, execution=execution) * dy)  # noqa: E731
        return compile_fast(jax.value_and_grad(loss), state)(state)

    (want, g_want), (got, g_got) = grads("reference"), grads("pallas")
    assert abs(float(got) - float(want)) <= 1e-4 * abs(float(want))
    for path in (("layers", "attn", "sinks"), ("layers", "attn", "q_proj", "kernel")):
        a, b = g_got, g_want
        for p in path:
            a, b = a[p], b[p]
        assert rel_err(a[...], b[...]) < 1e-4, path
