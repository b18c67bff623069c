"""An FP8 frozen base (`from_pretrained(quantize="fp8")`, `load_in_fp8`) on examples/tiny-llama: every targeted
linear but lm_head holds float8_e4m3fn codes and per-channel scales (`Fp8Weight`, selected by type, quantised from
the loaded kernel bit for bit); logits stay close to the unquantised base's, dequantised (the CPU's `auto`) and
through the FP8 GEMMs (over the unrolled layers; the step holds f8 x f8 dots); loss and LoRA gradients equal those
of the dense model holding the dequantised weights; `save_pretrained` writes those weights, which transformers
loads; a short `jaxft-train` run trains and exports an ordinary PEFT adapter for the unquantised base; FP8 with
4 bits is refused in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors.numpy import load_file

import jaxft
from jaxft.memory.execution import ExecutionConfig
from jaxft.lora import LoraConfig, apply_lora
from jaxft.models.layers import Fp8Weight, LoraParam, QuantFp8, linears
from jaxft.quant import Fp8Config
from jaxft.quant.fp8 import program_options as fp8_program_options
from jaxft.run import Run
from jaxft.train import TrainConfig, split_model, train, unstack_layers
from jaxft.train.config import TrainConfigError
from jaxft.train.step import token_loss_sum
from kernels_pallas.fp8_matmul import dequantize_fp8, quantize_rows
from test_train_fixtures import make_tiny_model
from lora_helpers import hf_model_fp32, jax_logits, perturb_lora_b, rel_err, torch_logits

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny-llama"
EXECUTION = ExecutionConfig(attention_implementation="reference", remat="none")
SITES = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _lora(model):
    apply_lora(model, LoraConfig(r=8, alpha=16, target_modules="all-linear"), seed=0)
    perturb_lora_b(model)  # B = 0 would leave dA = 0: nothing to compare
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(bf16 base, FP8 base, FP8 base on the FP8 GEMMs, the FP8 base's export reloaded dense, its directory, a
    batch), fp32 compute; LoRA on each with the same seed and B."""
    dense = _lora(jaxft.from_pretrained(TINY, "float32", verbose=False))
    fp8 = jaxft.from_pretrained(TINY, "float32", quantize="fp8", verbose=False)
    exported = jaxft.save_pretrained(fp8, tmp_path_factory.mktemp("fp8") / "merged")  # before LoRA: the base alone
    twin = _lora(jaxft.from_pretrained(exported, "float32", verbose=False))
    gemm = _lora(jaxft.from_pretrained(TINY, "float32", quant_config=Fp8Config(implementation="xla_fp8"),
                                       verbose=False))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, dense.config.vocab_size, (2, 65)))
    batch = dict(input_ids=ids[:, :-1], targets=ids[:, 1:], loss_mask=jnp.ones((2, 64)), segment_ids=None,
                 positions=None)
    return dict(dense=dense, fp8=_lora(fp8), gemm=gemm, twin=twin, exported=exported, batch=batch)


def _loss_and_grads(model, batch):
    graphdef, lora, frozen = split_model(model)
    fn = jax.jit(jax.value_and_grad(lambda lr, fz: token_loss_sum(nnx.merge(graphdef, lr, fz), batch,
                                                                  execution=EXECUTION)))
    return fn, (lora, frozen)


def _logits(models, name, unroll=False):
    """The LoRA model `name`'s logits on the batch (over per-layer weight buffers: `unroll`), computed once."""
    key = f"logits_{name}"
    if key not in models:
        model = models[name]
        if unroll:
            graphdef, lora, frozen = split_model(model)
            model = nnx.merge(graphdef, lora, unstack_layers(frozen))
        models[key] = jax_logits(model, models["batch"]["input_ids"])
    return models[key]


def _frob(a, b) -> float:
    a, b = np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_targeted_linears_hold_fp8_codes_quantised_from_the_loaded_kernels(models):
    dense, fp8 = models["dense"], models["fp8"]
    kept = {p for p, lin in linears(fp8) if lin.quant is None}
    assert kept == {"lm_head"} and fp8.quant_skipped == ("lm_head",)
    for path in SITES:
        lin, ref = fp8.layers, dense.layers
        for part in path.split("."):
            lin, ref = getattr(lin, part), getattr(ref, part)
        assert isinstance(lin.quant, QuantFp8) and lin.kernel is None
        kernel = ref.kernel[...]  # [L, in, out]
        q, scale = jax.jit(jax.vmap(lambda k: quantize_rows(k.T)))(kernel)  # one program (eager: one per op)
        assert lin.quant.q.dtype == jnp.float8_e4m3fn and lin.quant.q.shape == (4, *kernel.shape[:0:-1])
        np.testing.assert_array_equal(np.asarray(lin.quant.q[...]).view(np.uint8), np.asarray(q).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(lin.quant.scale[...]), np.asarray(scale))
    # Selected by type: the FP8 storage is frozen state, never LoRA state, and it is all of the linears' storage.
    _, lora, frozen = split_model(fp8)
    assert not [v for _, v in nnx.to_flat_state(lora) if not isinstance(v, LoraParam)]
    stored = [v for _, v in nnx.to_flat_state(frozen) if isinstance(v, Fp8Weight)]
    assert len(stored) == 2 * len(SITES)


def test_logits_close_to_the_unquantised_base(models):
    want = _logits(models, "dense")
    # The weights alone rounded to e4m3: 1.3 % here (the bf16 base is 0.5 % from fp32); with the activations
    # rounded to e4m3 too (the FP8 GEMMs, here over the unrolled layers) 2.8 %.
    assert 0 < _frob(_logits(models, "fp8"), want) < 0.02
    assert 0 < _frob(_logits(models, "gemm", unroll=True), want) < 0.04


def test_lora_gradients_equal_the_dequantised_twins(models):
    """The oracle is the dense model holding the dequantised weights (the export): on this random tiny model the
    LoRA gradients are ill-conditioned (rounding the base to bf16 moves them 4 %, to e4m3 28 %), so the FP8 base's
    distance from the original base measures the model, not the implementation."""
    batch = models["batch"]
    fn, args = _loss_and_grads(models["twin"], batch)
    want_loss, want = fn(*args)
    fn, args = _loss_and_grads(models["fp8"], batch)
    loss, grads = fn(*args)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        assert _frob(g, w) < 1e-5
    # The scanned FP8-GEMM step: the 7 linears of the layer body have their forward and input-gradient GEMMs on
    # e4m3 operands with an fp32 result.
    fn, args = _loss_and_grads(models["gemm"], batch)
    text = fn.lower(*args).as_text()
    dots = [ln for ln in text.splitlines() if "stablehlo.dot_general" in ln and ln.count("f8E4M3FN") >= 2]
    assert len(dots) == 2 * len(SITES) and all(re.search(r"-> tensor<[\dx]+xf32>", ln) for ln in dots)


def test_save_pretrained_writes_dequantised_weights_transformers_loads(models, tmp_path):
    fp8, out = models["fp8"], models["exported"]
    with pytest.raises(ValueError, match="base is FP8, which has no bitsandbytes format"):
        jaxft.save_pretrained(fp8, tmp_path / "q", quantized=True)
    with pytest.raises(ValueError, match=r"^merge_lora: layers\.\w+\.\w+ is an FP8 linear; merging would need"):
        jaxft.merge_lora(fp8)
    hf = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in hf
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    quant = fp8.layers.mlp.down_proj.quant
    want = np.asarray(dequantize_fp8(quant.q[...][2], quant.scale[...][2], jnp.float32))  # torch's [out, in]
    np.testing.assert_array_equal(tensors["model.layers.2.mlp.down_proj.weight"], want)
    # The merged export of the LoRA model on the FP8 base: transformers computes the FP8 model's logits.
    merged = jaxft.save_pretrained(fp8, tmp_path / "lora_merged")
    ref = torch_logits(hf_model_fp32(merged), np.asarray(models["batch"]["input_ids"]))
    assert rel_err(_logits(models, "fp8"), ref) < 1e-4


def _train_config(tmp_path, **overrides) -> TrainConfig:
    values = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    for key in ("model_name_or_path", "dataset", "eval_dataset"):
        values[key] = str(ROOT / values[key])
    values.update({"output_dir": str(tmp_path / "run"), "load_in_fp8": True, "remat": "none", "layer_loop": "scan",
                   **overrides})
    return TrainConfig(**values)


def test_fp8_keys_are_validated(tmp_path):
    cfg = _train_config(tmp_path)
    assert isinstance(cfg.quant_config, Fp8Config) and "lm_head" in cfg.quant_config.skip_modules
    assert _train_config(tmp_path, llm_int8_skip_modules=["down_proj"]).quant_config.skip_modules == ("down_proj",)
    assert _train_config(tmp_path, load_in_fp8=False).quant_config is None  # never on unless asked
    with pytest.raises(TrainConfigError, match="^keys 'load_in_fp8' and 'load_in_4bit' are both true; .* false$"):
        _train_config(tmp_path, load_in_4bit=True)
    with pytest.raises(TrainConfigError, match="key 'bnb_4bit_quant_type' is a 4-bit setting and load_in_fp8 is"):
        _train_config(tmp_path, bnb_4bit_quant_type="fp4")
    with pytest.raises(jaxft.ConfigError, match="Fp8Config.implementation: value 'fast' is invalid"):
        Fp8Config(implementation="fast")
    with pytest.raises(TrainConfigError, match="key 'llm_int8_skip_modules': value"):
        _train_config(tmp_path, llm_int8_skip_modules=[""])


def test_bench_recipes_are_fast_and_lean_on_an_fp8_base():
    from jaxft.train.config_file import load_config

    bench = ROOT / "examples" / "bench"
    for fp8, base in (("fp8", "fast"), ("fp8_lean", "lean")):
        got, want = load_config(bench / f"{fp8}.yaml"), load_config(bench / f"{base}.yaml")
        assert isinstance(got.quant_config, Fp8Config) and want.quant_config is None
        assert got.execution_config == want.execution_config and got.lora == want.lora and got.optim == want.optim
    balanced = load_config(bench / "fp8_balanced.yaml")
    assert isinstance(balanced.quant_config, Fp8Config)
    assert (balanced.execution_config.remat, balanced.execution_config.layer_loop) == ("offload+attn", "scan")


class _Device:
    def __init__(self, platform, compute_capability=""):
        self.platform, self.compute_capability = platform, compute_capability


def test_fp8_gemms_compile_without_triton_gemms_and_the_users_options_win(tmp_path):
    hopper, ampere, cpu = _Device("gpu", "9.0"), _Device("gpu", "8.0"), jax.devices("cpu")[0]
    assert fp8_program_options(Fp8Config(), hopper) == {"xla_gpu_enable_triton_gemm": False}
    for cfg, device in ((Fp8Config(), ampere), (Fp8Config(), cpu), (Fp8Config(implementation="xla"), hopper),
                        (None, hopper)):
        assert fp8_program_options(cfg, device) == {}
    # A run takes them in its step's program (here the FP8 GEMMs interpreted on the CPU, where the option is inert).
    make_tiny_model(tmp_path / "model")
    lora, fp8_gemms = LoraConfig(r=4, alpha=8, target_modules=("q_proj",)), Fp8Config(implementation="xla_fp8")
    mine = {"xla_gpu_enable_triton_gemm": True}
    run = Run(tmp_path / "model", lora, ExecutionConfig(compiler_options=mine), quant_config=fp8_gemms)
    assert run.execution.program_options == mine
    run = Run(tmp_path / "model", lora, quant_config=fp8_gemms)
    assert run.execution.program_options == {"xla_gpu_enable_triton_gemm": False}
    rows = np.ones((1, 16), np.int32)
    loss = run.load().step(dict(input_ids=rows, targets=rows, loss_mask=rows.astype(np.float32), segment_ids=rows,
                                positions=np.arange(16, dtype=np.int32)[None]), 0)["loss"]
    assert np.isfinite(float(loss))


def test_fp8_run_trains_and_exports_an_adapter_peft_loads_on_the_bf16_base(tmp_path):
    import peft

    held_out = tmp_path / "eval.jsonl"  # 40 of the 200 held-out chats: two eval batches
    held_out.write_text("".join((ROOT / "examples" / "data" / "eval.jsonl").read_text().splitlines(True)[:40]))
    cfg = _train_config(tmp_path, max_steps=6, logging_steps=3, eval_steps=6, save_steps=6, max_seq_length=256,
                        per_device_train_batch_size=2, per_device_eval_batch_size=4, warmup_steps=0,
                        eval_dataset=str(held_out))
    train(cfg)
    records = [json.loads(ln) for ln in (Path(cfg.logging.output_dir) / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0] - 0.1  # the held-out loss falls from its step-0 baseline
    adapter = Path(cfg.logging.output_dir) / "adapter"
    assert "quant" not in (adapter / "adapter_config.json").read_text()
    ids = np.random.default_rng(2).integers(0, 256, (1, 64))
    hf = peft.PeftModel.from_pretrained(hf_model_fp32(TINY), adapter).eval()
    ref = torch_logits(hf, ids)
    ours = jaxft.load_adapter(jaxft.from_pretrained(TINY, "float32", verbose=False), adapter)
    assert np.abs(np.asarray(ours.layers.mlp.up_proj.lora_b[...])).max() > 0  # trained away from B = 0
    assert rel_err(jax_logits(ours, ids), ref) < 1e-5  # an ordinary adapter: the dense base takes it as PEFT does
