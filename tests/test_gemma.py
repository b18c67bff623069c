"""Gemma 2 and Gemma 3 text against transformers + PEFT (the oracles), on tiny random models built here.

The configs make every Gemma detail bite: sliding windows (128) shorter than the 576-token inputs, softcaps of
5.0 (attention and final for Gemma 2, final for Gemma 3), query_pre_attn_scalar different from head_dim,
Gemma 3's 3:1 sliding/full layers with a local RoPE base and a linearly scaled global one, and norm weights
drawn away from 0 (with the (1 + w) form, w = 0 would hide an offset bug).
"""

from __future__ import annotations

import numpy as np
import peft
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import jax
import jax.numpy as jnp
from flax import nnx

import jaxft
from jaxft import lora
from jaxft.lora.targets import _modules
from jaxft.config import ConfigError, ModelConfig
from jaxft.memory.execution import ExecutionConfig
from jaxft.models import init_model, linears
from jaxft.train.step import token_loss_sum
from kernels_pallas.linear_cross_entropy import transposed_copies
from lora_helpers import perturb_lora_b, rel_err

SEQ = 576
VOCAB = 256
REFERENCE = ExecutionConfig(attention_implementation="reference", remat="none")
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6, query_pre_attn_scalar=24,
            sliding_window=128, pad_token_id=0, eos_token_id=1, bos_token_id=2)
CONFIGS = {
    "gemma2": dict(num_hidden_layers=3, attn_logit_softcapping=5.0, final_logit_softcapping=5.0),
    "gemma3_text": dict(
        num_hidden_layers=4, final_logit_softcapping=5.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}}),
}
KINDS = list(CONFIGS)


def _hf_model(model_type: str, seed: int = 0, **overrides):
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **CONFIGS[model_type], **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)  # offsets: 1 + w stays near 1 but far from exactly 1
            elif "embed_tokens" in name or "q_proj" in name or "k_proj" in name:
                p.normal_(0.0, 0.5)  # large logits and scores, so that both softcaps (5.0) bite
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for kind in KINDS:
        model = _hf_model(kind)
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path)
        out[kind] = (model, path)
    return out


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(3, VOCAB, (2, SEQ))


# jitted: one program per model structure and shape (op by op, every eager op of a new shape compiles on its own)
_forward = nnx.jit(lambda m, ids: m(ids))


def _logits(model, ids) -> np.ndarray:
    return np.asarray(_forward(model, jnp.asarray(ids)))


def _hf_logits(model, ids, **kw):
    with torch.no_grad():
        tokens = None if ids is None else torch.tensor(np.asarray(ids), dtype=torch.long)
        return model(tokens, **kw).logits.float().numpy()




# --------------------------------------------------------------------------- config


def test_config_maps_gemma_details(saved):
    g2 = jaxft.from_pretrained(saved["gemma2"][1], dtype="float32").config
    assert g2.layer_windows == (128, None, 128)  # Gemma 2 slides on even layers
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.hidden_act) == (5.0, 5.0, "gelu_pytorch_tanh")
    assert g2.attn_scale == pytest.approx(24 ** -0.5) and g2.tie_word_embeddings
    g3 = jaxft.from_pretrained(saved["gemma3_text"][1], dtype="float32").config
    assert g3.layer_ropes == ("local", "local", "global", "local") and g3.qk_norm
    assert (g3.rope.rope_type, g3.rope.factor, g3.rope.theta, g3.rope_local.theta) == ("linear", 4.0, 1e6, 1e4)
    for cfg in (g2, g3):
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg
        transformers.AutoConfig.for_model(**cfg.to_hf())  # transformers accepts what we write


def test_config_defaults_follow_transformers():
    base = dict(model_type="gemma3_text", vocab_size=8, hidden_size=8, intermediate_size=8, num_attention_heads=1,
                num_hidden_layers=7, rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear",
                                                                                               "factor": 8.0})
    cfg = ModelConfig.from_hf(base)  # transformers 4 keys: global scaled, local base from rope_local_base_freq
    ref = transformers.AutoConfig.for_model(**base)
    assert cfg.layer_windows == tuple(4096 if t == "sliding_attention" else None for t in ref.layer_types)
    assert (cfg.rope.factor, cfg.rope.theta, cfg.rope_local.rope_type, cfg.rope_local.theta) == (8.0, 1e6,
                                                                                                  "default", 1e4)
    assert ref.rope_parameters["full_attention"]["factor"] == 8.0


@pytest.mark.parametrize("hf, match", [
    (dict(model_type="gemma3"), r"multimodal Gemma 3.*'gemma3_text'"),
    (dict(model_type="gemma3_text", attn_logit_softcapping=50.0), r"not applied by transformers' Gemma3"),
    (dict(model_type="llama", partial_rotary_factor=0.5), r"partial_rotary_factor=0.5 is not supported by family "
                                                          r"'llama'"),
])
def test_unsupported_configs_are_one_clear_error(hf, match):
    full = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_attention_heads=1, num_hidden_layers=2, **hf)
    with pytest.raises(ConfigError, match=match) as info:
        ModelConfig.from_hf(full, source="m/config.json")
    assert str(info.value).startswith("m/config.json: ") and "\n" not in str(info.value)


# --------------------------------------------------------------------------- forward, loss, export


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(saved, ids, kind):
    hf, path = saved[kind]
    model = jaxft.from_pretrained(path, dtype="float32")
    got = _logits(model, ids)
    want = _hf_logits(hf, ids)
    assert np.abs(want).max() > 4.5  # the final softcap (5.0) is active
    assert rel_err(got, want) < 2e-4
    if kind == "gemma2":  # ... and so is the attention softcap: without it the logits move
        model.config = model.config.replace(attn_logit_softcap=None)
        assert rel_err(_logits(model, ids), want) > 1e-2


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_byte_identical(saved, tmp_path, kind):
    _, path = saved[kind]
    out = jaxft.save_pretrained(jaxft.from_pretrained(path, dtype="float32"), tmp_path / "out")
    src, dst = load_file(path / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(src) == sorted(dst)
    for name in src:
        assert src[name].dtype == dst[name].dtype and src[name].tobytes() == dst[name].tobytes(), name


def test_inputs_embeds_equal_scaled_token_embeddings(saved, ids):
    hf, path = saved["gemma2"]
    model = jaxft.from_pretrained(path, dtype="float32")
    embeds = model.embed_tokens(jnp.asarray(ids[:, :200]))  # includes the sqrt(hidden) scale
    got = np.asarray(nnx.jit(lambda m, e: m(inputs_embeds=e))(model, embeds))
    np.testing.assert_array_equal(got, _logits(model, ids[:, :200]))
    want = _hf_logits(hf, None, inputs_embeds=torch.tensor(np.asarray(embeds)))
    assert rel_err(got, want) < 2e-4
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        model(jnp.asarray(ids), inputs_embeds=embeds)


def test_tied_head_loss_reads_the_embedding_table_in_place(saved, ids):
    # The loss takes the tied table [V, H] as it is (Decoder.head_weight: layout "vh"). Handing it
    # `embedding.T` made XLA materialise a transposed copy of the table at the no-remat step's memory peak
    # (1.7 GiB on Gemma-2-9B, H200 target); the compiled LoRA gradient must hold no transpose of it.
    model = lora.apply_lora(jaxft.from_pretrained(saved["gemma2"][1], dtype="bfloat16"),
                            lora.LoraConfig(r=4, alpha=8, target_modules=("q_proj", "down_proj")))
    weight, layout = model.head_weight()
    assert layout == "vh" and weight.shape == (VOCAB, BASE["hidden_size"])
    graphdef, adapters, rest = nnx.split(model, lora.LoraParam, ...)
    t = 192  # not the vocabulary size, so no activation has the table's shape
    batch = dict(input_ids=jnp.asarray(ids[:1, :t]), targets=jnp.asarray(ids[:1, 1:t + 1]),
                 loss_mask=jnp.ones((1, t), jnp.float32), positions=None, segment_ids=None)

    chunked = REFERENCE.replace(ce_chunk_size=64)  # a loop over token chunks, as at training lengths

    def grad(a, frozen):  # the frozen weights an argument, as in the step (a closed-over table is folded)
        return jax.grad(lambda a: token_loss_sum(nnx.merge(graphdef, a, frozen), batch, execution=chunked))(a)

    hlo = jax.jit(grad).lower(adapters, rest).compile().as_text()
    copies = transposed_copies(hlo, (VOCAB, BASE["hidden_size"]))
    assert copies == [], copies[:2]


# --------------------------------------------------------------------------- LoRA and PEFT


DOCS = (150, 230)  # both longer than the 128 window; packed, they make one row of WIDTH tokens
WIDTH = sum(DOCS)


def _batch_of(row, seg):
    """The next-token batch of one row (the loss mask drops padding, segment 0, and document boundaries)."""
    keep = (seg[None, 1:] == seg[None, :-1]) & (seg[None, :-1] > 0)
    return dict(input_ids=jnp.asarray(row[None, :-1]), targets=jnp.asarray(row[None, 1:]),
                loss_mask=jnp.asarray(keep.astype(np.float32)), segment_ids=jnp.asarray(seg[None, :-1]),
                positions=None)


@pytest.fixture(scope="module", params=KINDS)
def lora_grad(saved, request):
    """(kind, LoRA model (all-linear, B perturbed), jitted loss sum and LoRA gradients of one row of WIDTH tokens):
    every gradient test of a kind feeds rows of that one shape, so they share one compile."""
    kind = request.param
    model = lora.apply_lora(jaxft.from_pretrained(saved[kind][1], dtype="float32"),
                            lora.LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    perturb_lora_b(model)
    graphdef, params, rest = nnx.split(model, lora.trainable_filter, ...)

    @jax.jit
    def loss_and_grad(batch):
        return jax.value_and_grad(lambda p: token_loss_sum(nnx.merge(graphdef, p, rest), batch,
                                                           execution=REFERENCE))(params)

    return kind, model, loss_and_grad


def test_lora_gradients_equal_peft(saved, ids, tmp_path, lora_grad):
    kind, model, loss_and_grad = lora_grad
    path = saved[kind][1]
    row = np.asarray(ids[0, :WIDTH])
    loss, grads = loss_and_grad(_batch_of(row, np.ones(WIDTH, np.int32)))  # one document: every target counts
    lora.save_adapter(model, tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    reference = peft.PeftModel.from_pretrained(base, tmp_path / "adapter", is_trainable=True)
    t = torch.tensor(row[None], dtype=torch.long)
    logits = reference(t[:, :-1]).logits.float()
    ref_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), t[:, 1:].reshape(-1), reduction="sum")
    ref_loss.backward()
    assert float(loss) == pytest.approx(ref_loss.item(), rel=1e-5)
    flat = {tuple(str(p) for p in path): np.asarray(v[...]) for path, v in nnx.to_flat_state(grads)}
    sites = {site.path: site for site in _modules(model).sites}
    modules = dict(reference.base_model.model.named_modules())
    compared = 0
    for p, lin in linears(model):
        key = tuple(p.split("."))
        for layer, name in enumerate(sites[key].names()):
            ref_a = modules[name].lora_A["default"].weight.grad.numpy()
            ref_b = modules[name].lora_B["default"].weight.grad.numpy()
            assert rel_err(flat[(*key, "lora_a")][layer].T, ref_a) < 1e-4, name
            assert rel_err(flat[(*key, "lora_b")][layer].T, ref_b) < 1e-4, name
            compared += 1
    assert compared == 7 * model.config.num_layers


def test_peft_adapter_round_trip_and_merged_export(saved, ids, tmp_path):
    """Both ways with PEFT and the merged export, on Gemma 3 (q/k norms, local and global RoPE). Gemma 2's
    jaxft adapter -> PEFT direction: test_lora_gradients_equal_peft."""
    hf, path = saved["gemma3_text"]
    cfg = lora.LoraConfig(r=4, alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    model = lora.apply_lora(jaxft.from_pretrained(path, dtype="float32"), cfg)
    perturb_lora_b(model, seed=3)
    ours = _logits(model, ids)
    # jaxft adapter -> PEFT
    lora.save_adapter(model, tmp_path / "ours")
    base = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, tmp_path / "ours").eval()
    assert rel_err(ours, _hf_logits(peft_model, ids)) < 2e-4
    # PEFT adapter -> jaxft
    base = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    theirs = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "gate_proj"]))
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    theirs.save_pretrained(tmp_path / "theirs")
    loaded = lora.load_adapter(jaxft.from_pretrained(path, dtype="float32"), tmp_path / "theirs")
    assert rel_err(_logits(loaded, ids), _hf_logits(theirs.eval(), ids)) < 2e-4
    # merged export loads in transformers with equal logits
    merged = jaxft.save_pretrained(model, tmp_path / "merged")
    again = transformers.AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    assert rel_err(ours, _hf_logits(again, ids)) < 2e-4


# --------------------------------------------------------------------------- packing, kernels, generation


@pytest.mark.parametrize("lora_grad", ["gemma3_text"], indirect=True)  # local + global RoPE restart per document
def test_packed_row_equals_each_document_alone(lora_grad):
    _, model, loss_and_grad = lora_grad
    rng = np.random.default_rng(7)
    docs = [rng.integers(3, VOCAB, n) for n in DOCS]
    packed = _batch_of(np.concatenate(docs), np.repeat([1, 2], DOCS).astype(np.int32))
    # The packed row's targets cross the document boundary at one position; its loss mask drops it. Each document
    # alone is padded to the packed row's length (padding: segment 0, no loss), so all three share one compile.
    alone = [_batch_of(np.pad(d, (0, WIDTH - len(d))), np.pad(np.ones(len(d), np.int32), (0, WIDTH - len(d))))
             for d in docs]
    l_packed, g_packed = loss_and_grad(packed)
    parts = [loss_and_grad(b) for b in alone]
    assert float(l_packed) == pytest.approx(sum(float(l) for l, _ in parts), rel=1e-5)
    for a, b, c in zip(jax.tree.leaves(g_packed), *(jax.tree.leaves(g) for _, g in parts)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b + c), rtol=1e-4, atol=1e-5 * float(jnp.abs(a).max()))
    # Logits: the packed row's first document against that document alone (padded to the row: one compile).
    forward = nnx.jit(lambda m, i, s: m(i, segment_ids=s))
    logits = np.asarray(forward(model, packed["input_ids"], packed["segment_ids"]))
    first = np.asarray(forward(model, alone[0]["input_ids"], alone[0]["segment_ids"]))
    assert rel_err(logits[0, :len(docs[0])], first[0, :len(docs[0])]) < 1e-5


def test_pallas_flash_attention_with_softcap_and_window_matches_reference():
    cfg = ModelConfig(model_type="gemma2", vocab_size=64, hidden_size=64, intermediate_size=48, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=64, layer_windows=(40, None), attn_logit_softcap=2.0,
                      final_logit_softcap=5.0, query_pre_attn_scalar=8.0)
    model = init_model(cfg, dtype=jnp.float32, seed=0)
    for lin in (model.layers.attn.q_proj, model.layers.attn.k_proj):
        lin.kernel[...] = lin.kernel[...] * 25.0  # scores of a few units: the cap of 2.0 bites
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, 128)))
    seg = jnp.asarray(np.repeat([1, 2], [50, 78])[None].astype(np.int32))
    # jitted: one program per forward (op by op, every eager op and interpreted kernel call compiles on its own)
    forward = nnx.jit(lambda m, execution: m(ids, segment_ids=seg, execution=execution), static_argnums=1)
    want = forward(model, REFERENCE)
    got = forward(model, ExecutionConfig(attention_implementation="pallas", remat="none"))
    assert rel_err(got, want) < 1e-5
    uncapped = model.config.replace(attn_logit_softcap=None)
    model.config = uncapped
    assert rel_err(forward(model, REFERENCE), want) > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_matches_transformers(saved, kind):
    from jaxft.generation import generate_ids

    hf, path = saved[kind]
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 140)]  # the second crosses the 128 window
    got = generate_ids(jaxft.from_pretrained(path, dtype="float32"), prompts, max_new_tokens=8)
    for prompt, row in zip(prompts, got):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, max_new_tokens=8)
        assert row == out[0, len(prompt):].tolist()
