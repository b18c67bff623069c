"""4-bit checkpoints against transformers + bitsandbytes on CPU (the oracle), on a tiny random Llama:
a bitsandbytes directory saved by transformers loads in jaxft with its bytes and its logits; jaxft quantises a
dense checkpoint with bitsandbytes' bytes and writes a directory transformers loads as `Linear4bit` with equal
logits; the merged export is dense; a QLoRA adapter trained in jaxft loads onto a bitsandbytes model in PEFT.

Tolerances: float32 runs compare relative logit error (max |a - b| / max |b|) at 1e-5 (the weights are
bit-identical, the matmul order is not); bfloat16 runs at 2e-2, and so do float32 runs through transformers' 4-bit
forward on a CPU where bitsandbytes computes it in bfloat16 (tests/bnb_helpers.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("bitsandbytes")
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import jaxft  # noqa: E402
from jaxft.models.layers import QuantizedWeight  # noqa: E402
from jaxft.quant import QuantConfig  # noqa: E402
from bnb_helpers import cpu_4bit_logit_tol, save_tiny_llama  # noqa: E402
from lora_helpers import perturb_lora_b, rel_err  # noqa: E402

SEQ = 520
VOCAB = 256
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
            tie_word_embeddings=False)
F32_TOL = 1e-5
# transformers' 4-bit forward as the oracle: float32 where bitsandbytes computes in float32, a bfloat16 tolerance on a
# CPU where its fused kernel rounds to bfloat16 (tests/bnb_helpers.py). The bytes are compared exactly either way.
HF_4BIT_TOL = cpu_4bit_logit_tol(F32_TOL)


def _bnb_config(double_quant=True, quant_type="nf4", dtype=torch.float32, skip=None):
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                           bnb_4bit_use_double_quant=double_quant, bnb_4bit_compute_dtype=dtype,
                                           llm_int8_skip_modules=skip)


def _hf_4bit(path, **kw):
    dtype = kw.pop("dtype", torch.float32)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=_bnb_config(dtype=dtype, **kw), device_map="cpu", dtype=dtype,
        attn_implementation="eager").eval()


def _hf_load(path, dtype=torch.float32):
    """A saved 4-bit directory as transformers loads it (its own quantization_config)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, device_map="cpu", dtype=dtype,
                                                             attn_implementation="eager").eval()


def _torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


def _logits(model, ids):
    return np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids)), np.float32)


def _tensors(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("base"), BASE)


@pytest.fixture(scope="module")
def bnb_dir(base, tmp_path_factory):
    """The base quantised by transformers + bitsandbytes (NF4, double quant) and saved."""
    path = tmp_path_factory.mktemp("bnb")
    _hf_4bit(base).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, VOCAB, (1, SEQ)).astype(np.int32)


def test_bitsandbytes_checkpoint_loads_with_its_bytes_and_logits(bnb_dir, ids):
    model = jaxft.from_pretrained(bnb_dir, dtype="float32")
    q = model.layers.attn.q_proj.quant
    files = _tensors(bnb_dir)
    assert np.array_equal(np.asarray(q.packed[...][1]), files["model.layers.1.self_attn.q_proj.weight"].numpy()[:, 0])
    assert np.array_equal(np.asarray(q.absmax[...][0]), files["model.layers.0.self_attn.q_proj.weight.absmax"].numpy())
    assert model.layers.mlp.down_proj.kernel is None and model.lm_head.quant is None
    # Quantised state is its own variable type, apart from Params (and from LoRA).
    assert len(nnx.to_flat_state(nnx.state(model, QuantizedWeight))) == 7 * 4
    assert rel_err(_logits(model, ids), _torch_logits(_hf_load(bnb_dir), ids)) < HF_4BIT_TOL


def test_quantize_on_load_matches_bitsandbytes_bytes(base, bnb_dir):
    cfg = QuantConfig(nested_rounding="cpu")  # the CPU oracle's rounding of the nested absmax
    model = jaxft.from_pretrained(base, dtype="float32", quant_config=cfg, verbose=False)
    files = _tensors(bnb_dir)
    for name in ("self_attn.k_proj", "mlp.up_proj", "mlp.down_proj"):
        lin = model.layers
        for part in {"self_attn": "attn"}.get(name.split(".")[0], "mlp"), name.split(".")[1]:
            lin = getattr(lin, part)
        for layer in range(2):
            hf = f"model.layers.{layer}.{name}.weight"
            assert np.array_equal(np.asarray(lin.quant.packed[...][layer]), files[hf].numpy()[:, 0]), hf
            state = json.loads(bytes(files[hf + ".quant_state.bitsandbytes__nf4"].numpy()))
            offset = float(lin.quant.offset[...][layer])
            assert abs(offset - state["nested_offset"]) <= 2 * np.spacing(np.float32(offset))


def test_jaxft_writes_a_directory_transformers_loads_as_4bit(base, ids, tmp_path):
    model = jaxft.from_pretrained(base, dtype="float32", quantize="nf4", double_quant=True, verbose=False)
    jaxft.save_pretrained(model, tmp_path / "q", quantized=True)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["bnb_4bit_use_double_quant"] is True
    assert config["quantization_config"]["llm_int8_skip_modules"] == ["lm_head"]
    hf = _hf_load(tmp_path / "q")
    import bitsandbytes as bnb
    assert isinstance(hf.model.layers[0].mlp.gate_proj, bnb.nn.Linear4bit)
    ours = _logits(model, ids)
    assert rel_err(ours, _torch_logits(hf, ids)) < HF_4BIT_TOL
    # ... and back: the written bytes load as they were.
    again = jaxft.from_pretrained(tmp_path / "q", dtype="float32")
    assert np.array_equal(np.asarray(again.layers.mlp.gate_proj.quant.packed[...]),
                          np.asarray(model.layers.mlp.gate_proj.quant.packed[...]))
    assert rel_err(_logits(again, ids), ours) < F32_TOL


@pytest.mark.parametrize("quant_type,double_quant", [("fp4", False), ("nf4", False)])
def test_other_formats_round_trip_through_transformers(base, ids, tmp_path, quant_type, double_quant):
    path = tmp_path / "bnb"
    _hf_4bit(base, quant_type=quant_type, double_quant=double_quant).save_pretrained(path)
    model = jaxft.from_pretrained(path, dtype="float32")
    assert model.layers.attn.o_proj.quant.quant_type == quant_type and not model.layers.attn.o_proj.quant.double_quant
    assert rel_err(_logits(model, ids), _torch_logits(_hf_load(path), ids)) < HF_4BIT_TOL


def test_bf16_checkpoint_logits(base, ids, tmp_path):
    path = tmp_path / "bnb16"
    _hf_4bit(base, dtype=torch.bfloat16).save_pretrained(path)
    model = jaxft.from_pretrained(path, dtype="bfloat16")
    ref = _torch_logits(_hf_load(path, torch.bfloat16), ids)
    assert rel_err(_logits(model, ids), ref) < 2e-2


def test_merged_export_is_dense_and_dequantised(bnb_dir, ids, tmp_path):
    model = jaxft.from_pretrained(bnb_dir, dtype="float32")
    model = jaxft.apply_lora(model, jaxft.LoraConfig(r=4, alpha=8))
    perturb_lora_b(model)
    jaxft.save_pretrained(model, tmp_path / "merged")
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    dense = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    assert rel_err(_torch_logits(dense, ids), _logits(model, ids)) < F32_TOL
    with pytest.raises(ValueError, match="LoRA adapters"):
        jaxft.save_pretrained(model, tmp_path / "q", quantized=True)
    with pytest.raises(ValueError, match="4-bit linear"):
        jaxft.merge_lora(model)


def test_qlora_adapter_loads_onto_bitsandbytes_model_in_peft(bnb_dir, ids, tmp_path):
    model = jaxft.apply_lora(jaxft.from_pretrained(bnb_dir, dtype="float32"), jaxft.LoraConfig(r=4, alpha=8))
    perturb_lora_b(model)
    jaxft.save_adapter(model, tmp_path / "adapter")
    hf = peft.PeftModel.from_pretrained(_hf_load(bnb_dir), tmp_path / "adapter").eval()
    assert rel_err(_logits(model, ids), _torch_logits(hf, ids)) < HF_4BIT_TOL


def _bnb_rel_error(weight: torch.Tensor) -> float:
    import bitsandbytes.functional as F
    q, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    back = F.dequantize_4bit(q, state)
    return float(torch.linalg.norm(back - weight) / torch.linalg.norm(weight))


def test_dynamic_4bit_keeps_sensitive_modules_dense(base, ids, tmp_path, capsys):
    # Heavy tails in v_proj (a few large weights per row): its blocks' absmax grows and the rest lose precision.
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for layer in hf.model.layers:
            w = layer.self_attn.v_proj.weight
            w[:, ::16] *= 12.0
    path = tmp_path / "tails"
    hf.save_pretrained(path)
    # The oracle's error per module (worst layer), and a threshold in the gap between v_proj and the rest.
    errors = {}
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
            site = name.split(".", 3)[-1]
            errors[site] = max(errors.get(site, 0.0), _bnb_rel_error(module.weight.detach()))
    worst_other = max(e for s, e in errors.items() if s != "self_attn.v_proj")
    assert errors["self_attn.v_proj"] > worst_other * 1.2
    threshold = (errors["self_attn.v_proj"] + worst_other) / 2
    cfg = QuantConfig(skip_modules=("lm_head", "mlp.down_proj"), max_rel_error=threshold)
    model = jaxft.from_pretrained(path, dtype="float32", quant_config=cfg)
    printed = capsys.readouterr().out
    assert "model.layers.{i}.mlp.down_proj: by name" in printed
    assert "model.layers.{i}.self_attn.v_proj: relative error" in printed and "MiB saved" in printed
    assert model.layers.attn.v_proj.quant is None and model.layers.mlp.down_proj.quant is None
    assert model.layers.attn.q_proj.quant is not None
    jaxft.save_pretrained(model, tmp_path / "q", quantized=True)
    skip = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["llm_int8_skip_modules"]
    assert skip == sorted(["lm_head"] + [f"model.layers.{i}.{m}" for i in range(2)
                                         for m in ("mlp.down_proj", "self_attn.v_proj")])
    loaded = _hf_load(tmp_path / "q")
    assert type(loaded.model.layers[0].self_attn.v_proj) is torch.nn.Linear
    assert rel_err(_torch_logits(loaded, ids), _logits(model, ids)) < HF_4BIT_TOL
