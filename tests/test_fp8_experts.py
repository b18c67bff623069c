"""MoE expert stacks in FP8 (`load_in_fp8` / quantize="fp8", and FP8 checkpoints' experts as stored) on tiny random
Qwen3-MoE and GPT-OSS models, CPU, fp32.

Checks: the grouped op's custom VJP equals autodiff of its definition; every expert holds e4m3 codes and a scale
per output channel, torch's float8 cast of its torch-layout weight bit for bit (routers and GPT-OSS's biases stay
dense); logits equal transformers' with every FP8 weight (linears and experts) dequantised in torch; the attention
and expert LoRA gradients equal those of the jaxft model whose experts are the dequantised weights; a checkpoint in
transformers' fine-grained FP8 layout (per-expert weights beside `weight_scale_inv`) loads as stored, codes and
block scales byte for byte, with the logits of transformers' own (CPU) dequantisation, and is dequantised exactly
where the load asks for 4 bits or skips the experts; the abstract model (compile before load) has the loaded
shapes; merge_lora refuses FP8 experts and the export holds them dequantised. A LoRA step's compiled temp memory
holds no dequantised FP8 expert stack: tests/test_quant_experts.py (one bf16 baseline for 4-bit and FP8 experts).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.torch
import torch
from flax import nnx
from safetensors.numpy import load_file

import jaxft
from jaxft import lora
from jaxft.models.layers import ExpertParam, Fp8ExpertWeight, QuantFp8
from jaxft.models.quant_experts import Fp8Experts, Quant4bitExperts
from jaxft.quant import DEFAULT_SKIP, Fp8Config
from jaxft.quant.experts import expert_sites
from jaxft.quant.fp8 import abstract_fp8
from jaxft.quant.weights import abstract_quantize, linear_sites
from kernels_pallas import fp8_matmul as fp8_ops
from lora_helpers import hf_model_fp32, jax_logits, perturb_lora_b, rel_err, tiny_qwen3_moe, torch_logits
from test_gpt_oss import gpt_oss_model

QWEN = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=1024, tie_word_embeddings=False, norm_topk_prob=True)
EXPERT_LORA = dict(r=4, alpha=8, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj",
                                                                               "experts.down_proj"])
KERNELS = ("gate_up_proj", "down_proj")
BLOCK = (16, 32)  # the checkpoint's weight_block_size: gate/up [32, 64] in 2 x 2 blocks, down [64, 32] in 4 x 1
SKIP_EXPERTS = Fp8Config(skip_modules=DEFAULT_SKIP + ("mlp.experts",))


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def base(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    (tiny_qwen3_moe(QWEN) if request.param == "qwen3_moe" else gpt_oss_model(seed=3)).save_pretrained(path)
    return request.param, path


def _fine_grained_fp8(dense, path):
    """`dense`'s weights in transformers' fine-grained FP8 layout at `path`: every projection of the layers
    (attention, experts, dense MLPs) as float8_e4m3fn in BLOCK blocks beside its weight_scale_inv."""
    state = safetensors.torch.load_file(str(dense / "model.safetensors"))
    out = {}
    for name, w in state.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            rows, cols = w.shape
            blocks = w.reshape(rows // BLOCK[0], BLOCK[0], cols // BLOCK[1], BLOCK[1])
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0
            out[name] = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
            out[name[: -len("weight")] + "weight_scale_inv"] = scale.float()
        else:
            out[name] = w
    path.mkdir(parents=True, exist_ok=True)
    hf = json.loads((dense / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(BLOCK), "fmt": "e4m3",
                                 "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(hf))
    safetensors.torch.save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(the fp32 Qwen3-MoE directory, the same weights in transformers' fine-grained FP8 layout)."""
    dense = tmp_path_factory.mktemp("qwen_dense")
    tiny_qwen3_moe(QWEN, seed=1).save_pretrained(dense)
    return dense, _fine_grained_fp8(dense, tmp_path_factory.mktemp("qwen_fp8"))


def _mlp(model):
    return model.layers.mlp


def _torch_codes(q) -> torch.Tensor:
    return torch.from_numpy(np.asarray(q).view(np.uint8).copy()).view(torch.float8_e4m3fn)


def _torch_dequant(q, scale) -> torch.Tensor:
    """fp32 [..., out, in] from our codes and scale grid, in torch (transformers' Fp8Dequantize arithmetic)."""
    codes, s = _torch_codes(q).float(), torch.from_numpy(np.array(scale))
    *lead, rows, cols = codes.shape
    gr, gc = s.shape[-2:]
    w = codes.reshape(*lead, gr, rows // gr, gc, cols // gc) * s[..., :, None, :, None]
    return w.reshape(*lead, rows, cols)


def _shapes(model):
    return {p: (type(v).__name__, v.shape, v.dtype) for p, v in nnx.to_flat_state(nnx.state(model))}


def test_grouped_op_custom_vjp_equals_autodiff_of_the_definition():
    rng = np.random.default_rng(0)
    q16, scale = fp8_ops.quantize_rows(jnp.asarray(rng.normal(size=(3, 64, 32)).astype(np.float32)))  # [G, out, in]
    grid = jnp.asarray(rng.uniform(0.5, 2.0, (3, 4, 2)).astype(np.float32))  # a scale per 16 x 16 block
    x = jnp.asarray(rng.normal(size=(10, 32)).astype(np.float32))
    sizes = jnp.asarray([4, 0, 5])  # the last row belongs to no group: zeros
    dy = jnp.asarray(rng.normal(size=(10, 64)).astype(np.float32))
    for s in (scale[..., None], grid):
        ref = jax.value_and_grad(lambda a: jnp.sum(fp8_ops.fp8_grouped_matmul(
            a, q16, s, sizes, implementation="reference") * dy))(x)
        got = jax.value_and_grad(lambda a: jnp.sum(fp8_ops.fp8_grouped_matmul(a, q16, s, sizes) * dy))(x)
        assert rel_err(got[0], ref[0]) < 1e-6 and rel_err(got[1], ref[1]) < 1e-6
        assert np.abs(np.asarray(got[1])).max() > 0 and np.all(np.asarray(got[1])[9] == 0)
    want = _torch_dequant(q16, grid).numpy()  # the grid's blocks, as transformers multiplies them
    np.testing.assert_array_equal(np.asarray(fp8_ops.dequantize_blocks(q16, grid, jnp.float32)), want)
    with pytest.raises(ValueError, match="scale must be"):
        fp8_ops.fp8_grouped_matmul(x, q16, grid[:, :3], sizes)
    with pytest.raises(ValueError, match="q must be float8_e4m3fn"):
        fp8_ops.fp8_grouped_matmul(x, q16.astype(jnp.float32), grid, sizes)


def test_expert_codes_are_torchs_float8_cast_per_output_channel(base):
    family, path = base
    dense = jaxft.from_pretrained(path, dtype="float32", verbose=False)
    fp8 = jaxft.from_pretrained(path, dtype="float32", quantize="fp8", verbose=False)
    assert expert_sites(fp8) == []  # no expert stack left dense
    for name in KERNELS:
        quant = getattr(_mlp(fp8), name)
        assert isinstance(quant, Fp8Experts) and isinstance(quant.q, Fp8ExpertWeight) and quant.block[0] == 1
        w = torch.from_numpy(np.array(getattr(_mlp(dense), name)[...])).transpose(-1, -2)  # [L, E, out, in]
        scale = w.abs().amax(dim=-1, keepdim=True) * np.float32(1 / 448)
        codes = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert np.array_equal(np.asarray(quant.q[...]).view(np.uint8), codes.view(torch.uint8).numpy())
        assert np.array_equal(np.asarray(quant.scale[...]), scale.numpy())
        assert quant.shape == getattr(_mlp(dense), name).shape
    for name in ("router", "gate_up_bias", "down_bias", "router_bias"):  # GPT-OSS's biases too
        var = getattr(_mlp(fp8), name, None)
        if var is not None:
            assert type(var) is nnx.Param and np.array_equal(np.asarray(var[...]),
                                                            np.asarray(getattr(_mlp(dense), name)[...]))


def test_logits_equal_transformers_with_every_fp8_weight_dequantised(base):
    family, path = base
    fp8 = jaxft.from_pretrained(path, dtype="float32", quantize="fp8", verbose=False)
    hf = hf_model_fp32(path)
    with torch.no_grad():
        for site in linear_sites(fp8):
            quant = site.linear(fp8).quant
            if isinstance(quant, QuantFp8):
                for row, name in enumerate(site.names()):
                    hf.get_parameter(name + ".weight").copy_(_torch_dequant(quant.q[...][row],
                                                                            quant.scale[...][row][:, None]))
        for name in KERNELS:
            quant = getattr(_mlp(fp8), name)
            for row in range(quant.q.shape[0]):
                w = _torch_dequant(quant.q[...][row], quant.scale[...][row])  # [E, out, in]
                param = hf.get_parameter(f"model.layers.{row}.mlp.experts.{name}")
                param.copy_(w if family == "qwen3_moe" else w.transpose(-1, -2))  # GPT-OSS keeps [E, in, out]
    ids = np.random.default_rng(4).integers(0, 128, (1, 96))
    assert rel_err(jax_logits(fp8, ids), torch_logits(hf, ids)) < 1e-5


# One family: both run their experts through `quant_experts.expert_matmul` (the FP8 grouped op's custom VJP);
# GPT-OSS's FP8 forward (its [E, in, out] layout, biases) is test_logits_equal_transformers_with_every_fp8_weight_
# dequantised[gpt_oss]; its block's gradients (biases, clamps) test_gpt_oss.py's against torch autograd.
@pytest.mark.parametrize("base", ["qwen3_moe"], indirect=True)
def test_lora_gradients_equal_the_model_with_dequantised_experts(base):
    family, path = base
    fp8 = jaxft.from_pretrained(path, dtype="float32", quantize="fp8", verbose=False)
    twin = jaxft.from_pretrained(path, dtype="float32", quant_config=SKIP_EXPERTS, verbose=False)
    for name in KERNELS:  # the same FP8 linears; the experts dense, holding the dequantised weights
        assert isinstance(getattr(_mlp(twin), name), ExpertParam)
        getattr(_mlp(twin), name)[...] = getattr(_mlp(fp8), name).dequantize(jnp.float32)
    rng = np.random.default_rng(2)
    ids = jnp.asarray(rng.integers(0, 128, (1, 96)))
    dy = jnp.asarray(rng.normal(size=(1, 96, 128)).astype(np.float32))

    def grads(model):
        lora.apply_lora(model, lora.LoraConfig(**EXPERT_LORA))
        perturb_lora_b(model, seed=5)
        graphdef, params, rest = nnx.split(model, lora.trainable_filter, ...)
        loss = lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(ids) * dy)  # noqa: E731
        value, g = jax.jit(jax.value_and_grad(loss))(params)
        return value, nnx.merge(graphdef, g, rest)

    (v8, g8), (vd, gd) = grads(fp8), grads(twin)
    assert rel_err(np.asarray(v8), np.asarray(vd)) < 1e-5
    for slot in ("gate_up_lora", "down_lora"):
        for factor in ("lora_a", "lora_b"):
            got = np.asarray(getattr(getattr(_mlp(g8), slot), factor)[...])
            want = np.asarray(getattr(getattr(_mlp(gd), slot), factor)[...])
            assert np.abs(want).max() > 0 and rel_err(got, want) <= 1e-5, (slot, factor)
    got, want = (np.asarray(g.layers.attn.q_proj.lora_a[...]) for g in (g8, gd))
    assert np.abs(want).max() > 0 and rel_err(got, want) <= 1e-5


def test_fine_grained_fp8_checkpoint_loads_as_stored(qwen, capsys):
    dense, path = qwen
    stored = safetensors.torch.load_file(str(path / "model.safetensors"))
    hf = hf_model_fp32(path)  # transformers dequantises FP8 on a CPU
    ids = np.random.default_rng(5).integers(0, 128, (1, 96))
    model = jaxft.from_pretrained(path, dtype="float32")
    assert "gate_up_proj in FP8 as stored (e4m3, a scale per 16 x 32 block)" in capsys.readouterr().out
    for name in KERNELS:
        quant = getattr(_mlp(model), name)
        assert isinstance(quant, Fp8Experts) and quant.block == BLOCK
        for layer in range(2):
            for e in range(4):
                hf_names = (["gate_proj", "up_proj"] if name == "gate_up_proj" else ["down_proj"])
                stem = [f"model.layers.{layer}.mlp.experts.{e}.{p}." for p in hf_names]
                codes = torch.cat([stored[s + "weight"] for s in stem]).view(torch.uint8).numpy()
                scale = torch.cat([stored[s + "weight_scale_inv"] for s in stem]).numpy()
                assert np.array_equal(np.asarray(quant.q[...][layer, e]).view(np.uint8), codes)
                assert np.array_equal(np.asarray(quant.scale[...][layer, e]), scale)
            # transformers' dequantised experts ([E, out, in] in its module) are ours, exactly
            want = hf.get_parameter(f"model.layers.{layer}.mlp.experts.{name}").detach().numpy()
            np.testing.assert_array_equal(_torch_dequant(quant.q[...][layer], quant.scale[...][layer]).numpy(), want)
    assert rel_err(jax_logits(model, ids), torch_logits(hf, ids)) < 1e-5
    # load_in_fp8: the experts stay as stored (no second rounding); the attention linears per channel.
    fp8 = jaxft.from_pretrained(path, dtype="float32", quantize="fp8", verbose=False)
    for name in KERNELS:
        got, want = getattr(_mlp(fp8), name), getattr(_mlp(model), name)
        assert got.block == BLOCK and np.array_equal(np.asarray(got.q[...]).view(np.uint8),
                                                     np.asarray(want.q[...]).view(np.uint8))
    assert isinstance(fp8.layers.attn.q_proj.quant, QuantFp8)
    # Asked for 4 bits, or to keep the experts dense: dequantised exactly as transformers does, then stored so.
    four = jaxft.from_pretrained(path, dtype="float32", quantize="nf4", verbose=False)
    assert all(isinstance(getattr(_mlp(four), n), Quant4bitExperts) for n in KERNELS)
    kept = jaxft.from_pretrained(path, dtype="float32", quant_config=SKIP_EXPERTS, verbose=False)
    for name in KERNELS:
        w = getattr(_mlp(kept), name)
        assert isinstance(w, ExpertParam)
        for layer in range(2):
            want = hf.get_parameter(f"model.layers.{layer}.mlp.experts.{name}").detach().numpy()
            np.testing.assert_array_equal(np.swapaxes(np.asarray(w[...][layer]), -1, -2), want)
    # Compiled before loading (jaxft.run.Run): the abstract models have the loaded shapes.
    for loaded, install in ((model, lambda m: abstract_quantize(m, path, None)),
                            (fp8, lambda m: abstract_fp8(m, Fp8Config(), path)),
                            (kept, lambda m: abstract_fp8(m, SKIP_EXPERTS, path))):
        def build(loaded=loaded, install=install):
            m = type(loaded)(loaded.config, dtype=jnp.float32, rngs=nnx.Rngs(0))
            install(m)
            return m

        assert _shapes(nnx.eval_shape(build)) == _shapes(loaded)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_fp8_experts_load_as_stored(qwen, tmp_path, strategy):
    """compressed-tensors FP8 experts (w = fp8 * weight_scale, per channel [out, 1] or per tensor [1]; the linears
    here dense): codes and scales as stored, gate's rows then up's, and exactly the weights they encode."""
    dense, _ = qwen
    state = safetensors.torch.load_file(str(dense / "model.safetensors"))
    out, exact = {}, {}
    for name, w in state.items():
        if ".experts." in name:
            amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
            scale = (amax / 448.0).float()
            stem = name[: -len("weight")]
            out[name], out[stem + "weight_scale"], out[stem + "input_scale"] = (w / scale).to(torch.float8_e4m3fn), \
                scale, torch.ones(1)
            exact[name] = out[name].float() * scale
        else:
            out[name] = w
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                                "symmetric": True, "dynamic": False}}
    hf = json.loads((dense / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                 "config_groups": {"group_0": group}, "ignore": ["lm_head"]}
    tmp_path.joinpath("config.json").write_text(json.dumps(hf))
    safetensors.torch.save_file(out, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = jaxft.from_pretrained(tmp_path, dtype="float32", verbose=False)
    gate_up, down = _mlp(model).gate_up_proj, _mlp(model).down_proj
    assert (gate_up.block, down.block) == (((1, 64), (1, 32)) if strategy == "channel" else ((32, 64), (64, 32)))
    assert model.layers.attn.q_proj.quant is None  # the linears were stored dense
    for layer in range(2):
        for e in range(4):
            stem = f"model.layers.{layer}.mlp.experts.{e}."
            want = torch.cat([exact[stem + "gate_proj.weight"], exact[stem + "up_proj.weight"]]).numpy()
            np.testing.assert_array_equal(np.asarray(gate_up.dequantize(jnp.float32)[layer, e]).T, want)
            np.testing.assert_array_equal(np.asarray(down.dequantize(jnp.float32)[layer, e]).T,
                                          exact[stem + "down_proj.weight"].numpy())


def test_fine_grained_fp8_checkpoint_with_dense_layers_maps_each_stack_to_its_layers(tmp_path):
    """mlp_only_layers=[1]: layers 0 and 2 are sparse (the `layers` stack), layer 1 dense (`dense_layers`); every
    FP8 tensor is read from its own layer."""
    dense = tmp_path / "dense"
    tiny_qwen3_moe({**QWEN, "num_hidden_layers": 3, "mlp_only_layers": [1]}, seed=2).save_pretrained(dense)
    path = _fine_grained_fp8(dense, tmp_path / "fp8")
    model = jaxft.from_pretrained(path, dtype="float32", verbose=False)
    assert isinstance(_mlp(model).down_proj, Fp8Experts) and _mlp(model).down_proj.q.shape[0] == 2
    ids = np.random.default_rng(6).integers(0, 128, (1, 64))
    assert rel_err(jax_logits(model, ids), torch_logits(hf_model_fp32(path), ids)) < 1e-5


def test_abstract_fp8_model_of_a_dense_checkpoint_has_the_loaded_shapes(qwen):
    dense, _ = qwen
    loaded = jaxft.from_pretrained(dense, dtype="bfloat16", quantize="fp8", verbose=False)

    def build():
        model = type(loaded)(loaded.config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        abstract_fp8(model, Fp8Config(), dense)
        return model

    shapes = _shapes(nnx.eval_shape(build))
    assert shapes == _shapes(loaded)
    assert sum(t == "Fp8ExpertWeight" for t, _, _ in shapes.values()) == 2 * len(KERNELS)


def test_merge_lora_refuses_fp8_experts_and_the_export_is_dequantised(qwen, tmp_path):
    dense, _ = qwen
    fp8 = jaxft.from_pretrained(dense, dtype="float32", quantize="fp8", verbose=False)
    out = jaxft.save_pretrained(fp8, tmp_path / "merged")
    tensors = load_file(out / "model.safetensors")
    quant = _mlp(fp8).down_proj
    want = _torch_dequant(quant.q[...][1], quant.scale[...][1]).numpy()  # [E, H, I]
    np.testing.assert_array_equal(tensors["model.layers.1.mlp.experts.2.down_proj.weight"], want[2])
    lora.apply_lora(fp8, lora.LoraConfig(**EXPERT_LORA))
    with pytest.raises(ValueError, match=r"^merge_lora: layers\.mlp\.\w+ holds FP8 experts; merging would need "
                                         r"re-quantising them\. Export the merged model"):
        lora.merge_lora(fp8)


@pytest.mark.slow  # a 6-step jaxft-train run (compile before load, unrolled layers)
def test_load_in_fp8_run_trains_expert_lora_on_fp8_experts(tmp_path, capsys):
    import test_moe_train as moe_train
    from jaxft.train import TrainConfig, train

    base = moe_train._model_dir(tmp_path)
    cfg = TrainConfig(**moe_train._values(tmp_path, base, load_in_fp8=True, max_steps=6, logging_steps=2,
                                          save_steps=6))
    result = train(cfg)
    assert "jaxft: 2 expert stack(s) in FP8 (e4m3, a scale per output channel)" in capsys.readouterr().out
    losses = [r["loss"] for r in map(json.loads, result.metrics_path.read_text().splitlines()) if "loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.05, losses
    adapter = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == sorted(moe_train.EXPERTS)
