"""bridge error paths: every bad checkpoint gives a CheckpointError naming the file, tensor and fix."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from bridge import CheckpointError, load_weights, read_config, table_for
from test_bridge_common import expected_for, make_model

TABLE = table_for("llama")
L = 2


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One untied tiny llama saved as a single file and as shards, plus its `expected`."""
    root = tmp_path_factory.mktemp("pristine")
    model = make_model("llama", seed=11)
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    expected = expected_for(transformers.AutoConfig.from_pretrained(root / "single"))
    return root, expected


@pytest.fixture
def ckpt(pristine, tmp_path):
    """A fresh copy of the single-file checkpoint to corrupt."""
    root, expected = pristine
    shutil.copytree(root / "single", tmp_path / "ckpt")
    return tmp_path / "ckpt", expected


def _rewrite(directory, edit):
    """Apply `edit` to the state dict of model.safetensors and write it back."""
    file = directory / "model.safetensors"
    state = load_file(file)
    edit(state)
    save_file(state, file, metadata={"format": "pt"})


def _load(directory, expected, num_layers=L):
    return load_weights(directory, TABLE, expected, num_layers)


def test_pristine_loads(ckpt):
    directory, expected = ckpt
    assert set(_load(directory, expected)) == set(expected)


def test_pickle_checkpoint_refused(tmp_path, pristine):
    directory = tmp_path / "pickled"
    directory.mkdir()
    shutil.copy(pristine[0] / "single" / "config.json", directory)
    # Never unpickled: the bytes need not even be a valid pickle.
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x04 not really a pickle")
    with pytest.raises(CheckpointError) as e:
        _load(directory, pristine[1])
    msg = str(e.value)
    # tests/test_model_paths.py runs the hinted conversion command and loads its output.
    for part in ("pytorch_model.bin", "pickle", "arbitrary code", "AutoModelForCausalLM", "AutoTokenizer",
                 str(directory)):
        assert part in msg, (part, msg)


def test_missing_tensor(ckpt):
    directory, expected = ckpt
    _rewrite(directory, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"1 tensors the model expects are missing") as e:
        _load(directory, expected)
    assert "model.layers.1.mlp.up_proj.weight (expected shape [48, 32])" in str(e.value)
    assert "num_hidden_layers" in str(e.value)


def test_missing_whole_family_when_config_claims_bias(ckpt):
    directory, expected = ckpt
    with_bias = dict(expected)
    with_bias[("layers", "attn", "o_proj", "bias")] = ((L, 32), np.float32)
    with pytest.raises(CheckpointError) as e:
        _load(directory, with_bias)
    msg = str(e.value)
    assert "model.layers.0.self_attn.o_proj.bias (expected shape [32])" in msg
    assert "model.layers.1.self_attn.o_proj.bias (expected shape [32])" in msg


def test_unexpected_tensors(ckpt):
    directory, expected = ckpt

    def edit(s):
        s["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)  # known row the model lacks
        s["model.layers.7.input_layernorm.weight"] = torch.zeros(32)  # layer beyond num_layers
        s["model.vision_tower.proj.weight"] = torch.zeros(2, 2)  # no row at all

    _rewrite(directory, edit)
    with pytest.raises(CheckpointError, match="3 tensors in the checkpoint are not used") as e:
        _load(directory, expected)
    msg = str(e.value)
    assert "model.layers.0.self_attn.q_proj.bias [64] in model.safetensors (maps to layers.attn.q_proj.bias" in msg
    assert "model.layers.7.input_layernorm.weight [32] in model.safetensors (layer 7 but the model has num_layers=2)" in msg
    assert "model.vision_tower.proj.weight [2, 2] in model.safetensors (no row in the mapping table)" in msg


def test_too_few_layers_in_config_is_unexpected(ckpt):
    directory, expected = ckpt
    one_layer = {p: (((1, *s[1:]) if p[0] == "layers" else s), d) for p, (s, d) in expected.items()}
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight .*layer 1 but the model has num_layers=1"):
        _load(directory, one_layer, num_layers=1)


def test_wrong_shape(ckpt):
    directory, expected = ckpt
    _rewrite(directory, lambda s: s.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(24, 32)))
    with pytest.raises(CheckpointError) as e:
        _load(directory, expected)
    msg = str(e.value)
    assert "model.layers.0.self_attn.k_proj.weight in model.safetensors: got [24, 32], expected [32, 32]" in msg
    assert "num_key_value_heads" in msg


def test_tied_head_in_file_ignored_only_if_equal_shaped(ckpt):
    directory, expected = ckpt  # untied checkpoint: it has lm_head.weight [96, 32]
    tied = {p: v for p, v in expected.items() if p != ("lm_head", "kernel")}
    out = _load(directory, tied)
    assert ("lm_head", "kernel") not in out
    _rewrite(directory, lambda s: s.__setitem__("lm_head.weight", torch.zeros(95, 32)))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight \[95, 32\] in model\.safetensors \(maps to lm_head\.kernel"):
        _load(directory, tied)


def test_quantized_dtype_refused(ckpt):
    directory, expected = ckpt
    _rewrite(directory, lambda s: s.__setitem__("model.norm.weight", torch.zeros(32, dtype=torch.int8)))
    with pytest.raises(CheckpointError, match=r"(?s)model\.norm\.weight in model\.safetensors: dtype I8.*quantized"):
        _load(directory, expected)


def test_truncated_file(ckpt):
    directory, expected = ckpt
    file = directory / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as e:
        _load(directory, expected)
    assert str(file) in str(e.value)


def test_corrupt_header(ckpt):
    directory, expected = ckpt
    file = directory / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:20] = b"#garbage!#@!"
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="not a valid safetensors file") as e:
        _load(directory, expected)
    assert str(file) in str(e.value) and "re-download" in str(e.value)


def test_header_length_beyond_file(ckpt):
    directory, expected = ckpt
    file = directory / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 40)
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="truncated or corrupt") as e:
        _load(directory, expected)
    assert str(file) in str(e.value)


def test_index_references_missing_shard(pristine, tmp_path):
    root, expected = pristine
    directory = shutil.copytree(root / "sharded", tmp_path / "sharded")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (directory / gone).unlink()
    with pytest.raises(CheckpointError) as e:
        _load(directory, expected)
    msg = str(e.value)
    assert "model.safetensors.index.json references shard files missing" in msg
    assert gone in msg and "download is incomplete" in msg


def test_sharded_loads_and_corrupt_shard_named(pristine, tmp_path):
    root, expected = pristine
    directory = shutil.copytree(root / "sharded", tmp_path / "sharded")
    full = _load(directory, expected)
    single = _load(root / "single", expected)
    for p in expected:
        np.testing.assert_array_equal(full[p], single[p])
    shard = sorted(directory.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match=shard.name):
        _load(directory, expected)


def test_invalid_index_json(pristine, tmp_path):
    root, expected = pristine
    directory = shutil.copytree(root / "sharded", tmp_path / "sharded")
    (directory / "model.safetensors.index.json").write_text('{\n  "weight_map": {\n    "a": "b",,\n  }\n}\n')
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: invalid JSON at line 3"):
        _load(directory, expected)


def test_no_weights_at_all(tmp_path, pristine):
    directory = tmp_path / "empty"
    directory.mkdir()
    (directory / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors or model\.safetensors\.index\.json.*adapter_model"):
        _load(directory, pristine[1])
    with pytest.raises(CheckpointError, match="does not exist"):
        _load(tmp_path / "nope", pristine[1])


def test_expected_path_not_in_table(ckpt):
    directory, expected = ckpt
    with pytest.raises(ValueError, match=r"expected path layers\.attn\.q_proj\.lora_a has no HF name"):
        _load(directory, {**expected, ("layers", "attn", "q_proj", "lora_a"): ((L, 32, 4), np.float32)})
    with pytest.raises(ValueError, match="must start with num_layers=2"):
        _load(directory, {**expected, ("layers", "input_norm", "scale"): ((3, 32), np.float32)})


def test_read_config_errors(tmp_path, pristine):
    good = read_config(pristine[0] / "single")
    assert good["model_type"] == "llama" and good["num_hidden_layers"] == L
    assert read_config(pristine[0] / "single" / "config.json") == good
    with pytest.raises(CheckpointError, match="does not exist"):
        read_config(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="has no config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text('{\n  "model_type": "llama",\n  "hidden_size": 32\n  "x": 1\n}\n')
    with pytest.raises(CheckpointError, match=r"config\.json: invalid JSON at line 4 column 3"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="top level must be a JSON object"):
        read_config(tmp_path)
