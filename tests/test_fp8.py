"""FP8 checkpoints in (`bridge.fp8`): transformers' fine-grained FP8 against transformers' own CPU dequantisation,
compressed-tensors FP8 (per channel, per tensor) against transformers on the dense weights w = fp8 * scale.

The checkpoints are written here on CPU in each format's layout: float8_e4m3fn weights beside float32 scales."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

import jaxft
from bridge import CheckpointError
from lora_helpers import hf_model_fp32, jax_logits, rel_err, torch_logits

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    config = transformers.AutoConfig.for_model("qwen3", **CONFIG)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, config


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, 256, (1, 48))


def _is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(".weight") and name.split(".")[-2] in LINEARS


def _write(path: Path, state: dict, config, quantization_config: dict | None) -> Path:
    path.mkdir(parents=True)
    hf = config.to_dict()
    if quantization_config is not None:
        hf["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(hf), encoding="utf-8")
    safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"),
                                metadata={"format": "pt"})
    return path


def _block_fp8(w: torch.Tensor, bm: int, bn: int):
    rows, cols = w.shape
    blocks = w.reshape(rows // bm, bm, cols // bn, bn)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
    return q, scale.float()


def test_fine_grained_fp8_equals_transformers_dequantisation(tmp_path, dense, ids):
    state, config = dense
    fp8 = {}
    for name, w in state.items():
        if _is_linear(name):
            fp8[name], fp8[name[: -len("weight")] + "weight_scale_inv"] = _block_fp8(w, 16, 32)
        else:
            fp8[name] = w
    path = _write(tmp_path / "fp8", fp8, config, {"quant_method": "fp8", "weight_block_size": [16, 32],
                                                  "activation_scheme": "dynamic", "fmt": "e4m3"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.model.layers[0].mlp.down_proj.weight.dtype == torch.float32  # transformers dequantised it
    ref = torch_logits(hf, ids)
    ours = jaxft.from_pretrained(path, dtype="float32", verbose=False)
    assert rel_err(jax_logits(ours, ids), ref) < 1e-5
    dense_ref = torch_logits(hf_model_fp32(_write(tmp_path / "dense", state, config, None)), ids)
    assert rel_err(ref, dense_ref) > 1e-4  # FP8 changed the weights: the parity above is not the dense model's


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_fp8_equals_the_dense_weights_it_encodes(tmp_path, dense, ids, strategy):
    state, config = dense
    fp8, exact = {}, {}
    for name, w in state.items():
        if _is_linear(name):
            amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
            scale = (amax / FP8_MAX).float()
            q = (w / scale).to(torch.float8_e4m3fn)
            stem = name[: -len("weight")]
            fp8[name], fp8[stem + "weight_scale"], fp8[stem + "input_scale"] = q, scale, torch.ones(1)
            exact[name] = q.float() * scale
        else:
            fp8[name] = exact[name] = w
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                                "symmetric": True, "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}
    path = _write(tmp_path / "ct", fp8, config, {"quant_method": "compressed-tensors", "format": "float-quantized",
                                                 "config_groups": {"group_0": group}, "ignore": ["lm_head"]})
    ours = jaxft.from_pretrained(path, dtype="float32", verbose=False)
    ref = torch_logits(hf_model_fp32(_write(tmp_path / "exact", exact, config, None)), ids)
    assert rel_err(jax_logits(ours, ids), ref) < 1e-5


def test_unsupported_fp8_layouts_are_one_clear_error(tmp_path, dense):
    state, config = dense
    path = _write(tmp_path / "int4", state, config, {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}})
    with pytest.raises(CheckpointError, match="group_0.weights is int 4-bit, strategy 'group'; jaxft reads"):
        jaxft.from_pretrained(path, dtype="float32")
    path = _write(tmp_path / "noblock", state, config, {"quant_method": "fp8", "weight_block_size": None})
    with pytest.raises(CheckpointError, match="weight_block_size=None"):
        jaxft.from_pretrained(path, dtype="float32")
    path = _write(tmp_path / "noscale", state, config, {"quant_method": "fp8", "weight_block_size": [16, 16]})
    with pytest.raises(CheckpointError, match="no linear weight has a <module>.weight_scale_inv"):
        jaxft.from_pretrained(path, dtype="float32")
