"""GPT-OSS MXFP4 checkpoints against transformers' own dequantiser, fp32, CPU.

Checks: jaxft's decoder equals transformers' `convert_moe_packed_tensors` on random codes and exponents (LOW nibble
= even index, E8M0 scales, the [E, out, in] -> [E, in, out] transpose); jaxft's encoder is lossless on decoded
values; a tiny MXFP4 checkpoint written from known weights with jaxft's encoder loads in transformers
(`Mxfp4Config(dequantize=True)`) and in jaxft with identical expert tensors and equal logits at 520 tokens; the
merged export is a bf16/fp32 HF directory without quantization_config that transformers loads with our logits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import jaxft
from bridge import mxfp4
from test_gpt_oss import TINY, gpt_oss_model
from lora_helpers import hf_model_fp32, jax_logits, rel_err, torch_logits

EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def test_decoder_equals_transformers_dequantiser():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 48, 4, 16), dtype=np.uint8)  # E=3, out=48, in=128
    scales = rng.integers(112, 142, (3, 48, 4), dtype=np.uint8)
    ours = mxfp4.to_ours(blocks, scales)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    assert ours.shape == (3, 128, 48) and tuple(theirs.shape) == ours.shape
    np.testing.assert_array_equal(ours, theirs.numpy())
    # Element 0 of a block is the low nibble, element 1 the high one, times 2^(s - 127).
    assert ours[0, 0, 0] == mxfp4.FP4_VALUES[blocks[0, 0, 0, 0] & 15] * 2.0 ** (int(scales[0, 0, 0]) - 127)
    assert ours[0, 1, 0] == mxfp4.FP4_VALUES[blocks[0, 0, 0, 0] >> 4] * 2.0 ** (int(scales[0, 0, 0]) - 127)
    again = mxfp4.to_ours(*mxfp4.from_ours(ours))
    np.testing.assert_array_equal(again, ours)  # representable values encode losslessly


def _mxfp4_checkpoint(src, dst):
    """The checkpoint at `src` with its expert weights replaced by jaxft's MXFP4 encoding of them."""
    tensors = load_file(src / "model.safetensors")
    for name in [n for n in tensors if n.endswith(EXPERT_WEIGHTS)]:
        tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4.from_ours(tensors.pop(name))
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    gpt_oss_model(seed=1).save_pretrained(root / "dense")
    return root / "dense", _mxfp4_checkpoint(root / "dense", root / "mxfp4")


def _hf_dequantised(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()


def test_mxfp4_checkpoint_equals_transformers_dequantised_model(checkpoints, tmp_path):
    dense, quantised = checkpoints
    ids = np.random.default_rng(0).integers(0, TINY["vocab_size"], (1, 520))
    hf = _hf_dequantised(quantised)
    model = jaxft.from_pretrained(quantised, dtype="float32")
    mlp = model.layers.mlp
    for layer in range(TINY["num_hidden_layers"]):
        experts = hf.model.layers[layer].mlp.experts
        np.testing.assert_array_equal(np.asarray(mlp.gate_up_proj[...][layer]), experts.gate_up_proj.detach().numpy())
        np.testing.assert_array_equal(np.asarray(mlp.down_proj[...][layer]), experts.down_proj.detach().numpy())
    expected = torch_logits(hf, ids)
    ours = jax_logits(model, ids)
    assert rel_err(ours, expected) < 1e-5
    assert rel_err(ours, torch_logits(hf_model_fp32(dense), ids)) > 1e-4  # the 4-bit experts are what ran

    out = jaxft.save_pretrained(model, tmp_path / "merged")  # dense export of the decoded weights
    written = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in written
    assert not [n for n in load_file(out / "model.safetensors") if n.endswith(("_blocks", "_scales"))]
    assert rel_err(torch_logits(hf_model_fp32(out), ids), ours) < 1e-5


def test_mxfp4_problems_are_one_line(checkpoints, tmp_path):
    _, quantised = checkpoints
    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_file(quantised / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][:, :8]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    (bad / "config.json").write_text((quantised / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.down_proj_scales in model.safetensors is "
                                         r"uint8 \[4, 8, 1\], expected uint8 \[4, 64, 1\]"):
        jaxft.from_pretrained(bad, dtype="float32")
    with pytest.raises(ValueError, match=r"experts are MXFP4 .* load it without quantize="):
        jaxft.from_pretrained(quantised, dtype="float32", quantize="nf4")
