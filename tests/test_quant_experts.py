"""4-bit MoE experts with `load_in_4bit` (Qwen3-MoE and GPT-OSS, tiny random models, CPU).

Checks: every expert's bytes are bitsandbytes' `quantize_4bit` of that expert's torch-layout [out, in] weight
(plain absmax exactly; with double quantisation the nested bytes given bitsandbytes' offset); GPT-OSS's biases
and routers stay in the model dtype; the 4-bit model's logits and its expert-LoRA gradients equal those of the
dense model whose experts are the dequantised NF4 weights; the merged export is dense (bf16 when asked) and
loads in transformers with the 4-bit model's logits; a LoRA step's compiled temp memory holds no dequantised
expert stack (4-bit and FP8); the ahead-of-time abstract model has the loaded one's shapes; skip_modules keeps
experts dense; merge_lora refuses 4-bit experts in one line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

bnb_functional = pytest.importorskip("bitsandbytes.functional")
import torch  # noqa: E402

import jaxft  # noqa: E402
from jaxft import lora  # noqa: E402
from jaxft.models.layers import ExpertParam, QuantizedExpertWeight  # noqa: E402
from jaxft.models.quant_experts import Quant4bitExperts  # noqa: E402
from jaxft.quant import DEFAULT_SKIP, Fp8Config, QuantConfig  # noqa: E402
from jaxft.quant.experts import expert_sites  # noqa: E402
from lora_helpers import hf_model_fp32, jax_logits, perturb_lora_b, rel_err, tiny_qwen3_moe, torch_logits  # noqa: E402
from test_gpt_oss import gpt_oss_model  # noqa: E402

QWEN = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=1024, tie_word_embeddings=False, norm_topk_prob=True)
EXPERT_LORA = dict(r=4, alpha=8, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj",
                                                                               "experts.down_proj"])
KERNELS = ("gate_up_proj", "down_proj")  # both families: Qwen3-MoE's gate and up are one weight too


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def base(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    (tiny_qwen3_moe(QWEN) if request.param == "qwen3_moe" else gpt_oss_model(seed=3)).save_pretrained(path)
    return request.param, path


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, 128, (1, 512))


def _mlp(model):
    return model.layers.mlp


def _dequantised_twin(model4, path):
    """The fp32 model with the same 4-bit linears and, as dense `ExpertParam`s, the dequantised experts."""
    twin = jaxft.from_pretrained(path, dtype="float32", verbose=False,
                                 quant_config=QuantConfig(skip_modules=DEFAULT_SKIP + ("mlp.experts",)))
    for name in KERNELS:
        assert isinstance(getattr(_mlp(twin), name), ExpertParam)
        getattr(_mlp(twin), name)[...] = getattr(_mlp(model4), name).dequantize(jnp.float32)
    return twin


def test_expert_bytes_are_bitsandbytes_quantize_4bit_per_expert(base):
    family, path = base
    dense = jaxft.from_pretrained(path, dtype="float32", verbose=False)
    plain = jaxft.from_pretrained(path, dtype="float32", verbose=False, quant_config=QuantConfig(double_quant=False))
    nested = jaxft.from_pretrained(path, dtype="float32", verbose=False,
                                   quant_config=QuantConfig(nested_rounding="cpu"))
    same_offset = 0
    for name in KERNELS:
        q, qd = getattr(_mlp(plain), name), getattr(_mlp(nested), name)
        assert isinstance(q, Quant4bitExperts) and isinstance(q.packed, QuantizedExpertWeight)
        w = np.asarray(getattr(_mlp(dense), name)[...])  # [L, E, in, out]
        for layer in range(w.shape[0]):
            for e in range(w.shape[1]):
                t = torch.from_numpy(np.ascontiguousarray(w[layer, e].T))  # the expert in torch's [out, in]
                ref_q, ref_state = bnb_functional.quantize_4bit(t, blocksize=64, quant_type="nf4",
                                                                compress_statistics=False)
                assert np.array_equal(np.asarray(q.packed[...][layer, e]), ref_q.numpy().reshape(-1))
                assert np.array_equal(np.asarray(q.absmax[...][layer, e]), ref_state.absmax.numpy())
                ref_q, ref_state = bnb_functional.quantize_4bit(t, blocksize=64, quant_type="nf4",
                                                                compress_statistics=True)
                assert np.array_equal(np.asarray(qd.packed[...][layer, e]), ref_q.numpy().reshape(-1))
                # Our offset is the correctly rounded float32 mean (torch's float32 sum may be an ulp or two off);
                # where the two agree, the nested codes and nested absmax are bitsandbytes' bytes.
                ref_offset, ours = np.float32(ref_state.offset.item()), np.float32(qd.offset[...][layer, e])
                assert abs(ours - ref_offset) <= 2 * np.spacing(ref_offset)
                if ours == ref_offset:
                    same_offset += 1
                    assert np.array_equal(np.asarray(qd.absmax[...][layer, e]), ref_state.absmax.numpy())
                    assert np.array_equal(np.asarray(qd.nested_absmax[...][layer, e]),
                                          ref_state.state2.absmax.numpy())
    assert same_offset > 0
    if family == "gpt_oss":  # biases and the router stay dense, in the model dtype
        for name in ("gate_up_bias", "down_bias", "router", "router_bias"):
            var = getattr(_mlp(plain), name)
            assert type(var) is nnx.Param and var.dtype == jnp.float32
            assert np.array_equal(np.asarray(var[...]), np.asarray(getattr(_mlp(dense), name)[...]))


@pytest.fixture(scope="module")
def lora_steps(base, ids):
    """Per family: the 4-bit model with expert LoRA (B perturbed), and (loss, logits, LoRA gradients) of one jitted
    value-and-grad on the 512-token `ids`, of it and (Qwen3-MoE: the gradient test's family) of its dequantised
    dense twin (same adapter): one program each, shared by the gradient and the export tests. GPT-OSS (the export
    test alone): its logits only, one jitted forward."""
    family, path = base
    model4 = jaxft.from_pretrained(path, dtype="float32", quantize="nf4", verbose=False)
    dy = jnp.asarray(np.random.default_rng(2).normal(size=(*ids.shape, 128)).astype(np.float32))

    def adapted(model):
        lora.apply_lora(model, lora.LoraConfig(**EXPERT_LORA))
        perturb_lora_b(model, seed=5)
        return model

    if family != "qwen3_moe":
        return model4, (None, jax_logits(adapted(model4), ids), None), None
    twin = _dequantised_twin(model4, path)

    def grads(model):
        graphdef, params, rest = nnx.split(adapted(model), lora.trainable_filter, ...)

        def loss(p):
            logits = nnx.merge(graphdef, p, rest)(jnp.asarray(ids))
            return jnp.sum(logits * dy), logits

        (value, logits), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        return value, np.asarray(logits), nnx.merge(graphdef, g, rest)

    return model4, grads(model4), grads(twin)


# One family: both run their experts through `quant_experts.expert_matmul` (the 4-bit experts' custom VJP);
# GPT-OSS's 4-bit forward (its [E, in, out] layout, biases) is checked against transformers by
# test_merged_export_is_dense_and_loads_in_transformers_with_our_logits[gpt_oss].
@pytest.mark.parametrize("base", ["qwen3_moe"], indirect=True)
def test_logits_and_expert_lora_gradients_equal_the_dequantised_dense_model(lora_steps):
    _, (v4, logits4, g4), (vd, logits_d, gd) = lora_steps
    assert rel_err(logits4, logits_d) < 1e-5
    assert rel_err(np.asarray(v4), np.asarray(vd)) < 1e-5
    for slot in ("gate_up_lora", "down_lora"):
        for factor in ("lora_a", "lora_b"):
            got = np.asarray(getattr(getattr(_mlp(g4), slot), factor)[...])
            want = np.asarray(getattr(getattr(_mlp(gd), slot), factor)[...])
            assert np.abs(want).max() > 0
            assert rel_err(got, want) <= 1e-5, (slot, factor)


def test_merged_export_is_dense_and_loads_in_transformers_with_our_logits(base, ids, lora_steps, tmp_path):
    family, path = base
    model4, (_, logits4, _), _ = lora_steps  # the 4-bit model with its perturbed expert adapter, and its logits
    out = jaxft.save_pretrained(model4, tmp_path / "merged")
    assert rel_err(torch_logits(hf_model_fp32(out), ids), logits4) < 1e-5
    # A bf16 model's export is bf16 and holds exactly the dequantised experts (no adapter here).
    bf16 = jaxft.from_pretrained(path, dtype="bfloat16", quantize="nf4", verbose=False)
    back = jaxft.from_pretrained(jaxft.save_pretrained(bf16, tmp_path / "bf16"), dtype="bfloat16", verbose=False)
    for name in KERNELS:
        stored = getattr(_mlp(back), name)
        assert isinstance(stored, ExpertParam) and stored.dtype == jnp.bfloat16
        assert np.array_equal(np.asarray(stored[...], np.float32),
                              np.asarray(getattr(_mlp(bf16), name).dequantize(jnp.bfloat16), np.float32))


@pytest.mark.slow  # three compiles of a 4-layer step
def test_lora_step_temp_memory_holds_no_dequantised_experts(tmp_path):
    """The compiled gradient program (XLA memory analysis) of an 8-expert model at 32 tokens with its experts in 4
    bits and in FP8 (the attention linears dense here: the experts alone differ), at 2 and at 4 layers. Each layer
    more adds well under ONE layer's dequantised experts to the temp memory: a backward that saved every layer's
    dequantised weights (autodiff of dequantise-then-matmul) adds one per layer. Measured per layer, in units of
    one layer's dequantised experts: 0.33 (NF4: the routed tokens' expert activations and the 4-bit residuals),
    0.82 (FP8). And against the dense model at 4 layers, the stored arrays shrink by most of the experts' bytes (4
    bits; with all the linears in 4 bits too) or by about three quarters of them (FP8: one byte a weight, a
    float32 scale per output channel). fp32: the dequantised copies are the compute dtype's whichever it is, and
    the CPU compiles fp32 programs faster than bf16 ones."""
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (1, 32)))
    layer_bytes = 3 * 8 * 64 * 128 * 4  # one layer's experts (gate, up, down) dequantised in fp32
    fp8 = dict(quant_config=Fp8Config(skip_modules=DEFAULT_SKIP + ("q_proj", "k_proj", "v_proj", "o_proj")))

    def model(layers: int, **load):
        path = tmp_path / str(layers)
        if not path.exists():
            cfg = dict(QWEN, hidden_size=64, moe_intermediate_size=128, num_hidden_layers=layers, num_experts=8)
            tiny_qwen3_moe(cfg).save_pretrained(path)
        m = jaxft.from_pretrained(path, dtype="float32", verbose=False, **load)
        lora.apply_lora(m, lora.LoraConfig(**EXPERT_LORA))
        return m

    def temp_bytes(m) -> int:
        graphdef, params, rest = nnx.split(m, lora.trainable_filter, ...)
        loss = lambda p, r: jnp.sum(nnx.merge(graphdef, p, r)(ids))  # noqa: E731
        return jax.jit(jax.grad(loss)).lower(params, rest).compile().memory_analysis().temp_size_in_bytes

    def stored_bytes(m) -> int:  # the step's arguments: every array of the model
        return sum(x.nbytes for x in jax.tree.leaves(nnx.state(m)))

    dense, four, eight = model(4), model(4, quantize="nf4"), model(4, **fp8)
    for at_4, load in ((four, dict(quantize="nf4")), (eight, fp8)):
        per_layer = (temp_bytes(at_4) - temp_bytes(model(2, **load))) / 2
        assert 0 < per_layer < layer_bytes, (load, per_layer / layer_bytes)
    experts_bytes = 4 * layer_bytes
    assert stored_bytes(dense) - stored_bytes(four) > 0.8 * experts_bytes
    assert 0.7 * experts_bytes < stored_bytes(dense) - stored_bytes(eight) < 0.75 * experts_bytes


def test_abstract_model_has_the_loaded_shapes(base):
    from jaxft.models.build import model_class
    from jaxft.quant.weights import abstract_quantize

    family, path = base
    loaded = jaxft.from_pretrained(path, dtype="bfloat16", quantize="nf4", verbose=False)

    def build():  # as jaxft.run.Run compiles before loading
        model = model_class(loaded.config)(loaded.config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        abstract_quantize(model, path, QuantConfig())
        return model

    abstract = nnx.eval_shape(build)

    def shapes(m):
        return {p: (type(v).__name__, v.shape, v.dtype) for p, v in nnx.to_flat_state(nnx.state(m))}

    assert shapes(abstract) == shapes(loaded)
    assert any(t == "QuantizedExpertWeight" for t, _, _ in shapes(abstract).values())


def test_skip_modules_keeps_experts_dense_and_merge_lora_refuses_4bit_experts(base, capsys):
    family, path = base
    kept = jaxft.from_pretrained(path, dtype="float32",
                                 quant_config=QuantConfig(skip_modules=DEFAULT_SKIP + ("experts.down_proj",)))
    assert "kept in float32 (skip_modules): model.layers.{i}.mlp.experts.down_proj" in capsys.readouterr().out
    assert isinstance(_mlp(kept).down_proj, ExpertParam)
    assert all(isinstance(getattr(_mlp(kept), n), Quant4bitExperts) for n in KERNELS if n != "down_proj")
    assert [s.path[-1] for s in expert_sites(kept)] == ["down_proj"]  # the sites are the ExpertParams left
    lora.apply_lora(kept, lora.LoraConfig(**EXPERT_LORA))
    with pytest.raises(ValueError, match=r"^merge_lora: layers\.mlp\.\w+ holds 4-bit experts; merging would need "
                                         r"re-quantising them\. Export the merged model"):
        lora.merge_lora(kept)
