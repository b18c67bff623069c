"""bridge: HF safetensors checkpoints <-> flat tree arrays, against transformers as oracle."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from bridge import (
    TABLES,
    Row,
    flatten_tree,
    load_weights,
    read_config,
    save_weights,
    table_for,
    unflatten_tree,
)
from test_bridge_common import ARCHS, ORACLE_NAMES, bits, expected_for, make_model, oracle_tensor

BF16 = np.dtype(ml_dtypes.bfloat16)


def _save_hf(model, directory, **kwargs):
    model.save_pretrained(directory, **kwargs)
    return directory


def _load(directory, dtype=np.float32, override=None):
    config = read_config(directory)
    hf_config = transformers.AutoConfig.from_pretrained(directory)
    expected = expected_for(hf_config, dtype)
    out = load_weights(directory, table_for(config["model_type"]), expected, config["num_hidden_layers"], override)
    return out, expected, hf_config


# ----------------------------------------------------------------------------- tables


def test_tables_cover_supported_types_and_agree_with_oracle():
    assert set(TABLES) == {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "qwen3_moe", "gpt_oss",
                           "qwen2_vl", "qwen2_5_vl"}
    for model_type, table in TABLES.items():
        if model_type.startswith("gemma") or model_type in ("qwen3_moe", "gpt_oss", "qwen2_vl", "qwen2_5_vl"):
            continue  # four norms per layer: tests/test_gemma.py; experts: tests/test_moe.py, tests/test_gpt_oss.py;
            # VLMs: tests/test_qwen2_vl.py
        assert table is table_for(model_type)
        by_path = {row.path: row for row in table}
        assert set(by_path) == set(ORACLE_NAMES), model_type
        for path, (template, transposed) in ORACLE_NAMES.items():
            row = by_path[path]
            assert row.hf == template.replace("{}", "{i}")
            assert row.stacked == ("{}" in template)
            assert row.transform == ("transpose" if transposed else None)
            hf, p, t, stacked = row  # rows unpack like 4-tuples
            assert (hf, p, t, stacked) == (row.hf, row.path, row.transform, row.stacked)


def test_table_for_unknown_type_lists_supported():
    with pytest.raises(ValueError, match=r"unsupported model_type 'gemma3'.*gemma2, gemma3_text, gpt_oss, llama, mistral"):
        table_for("gemma3")


def test_row_validation():
    with pytest.raises(ValueError, match="stacked=True"):
        Row("model.norm.weight", ("final_norm", "scale"), None, True)
    with pytest.raises(ValueError, match="unknown transform 'rotate'; registered: transpose"):
        Row("model.norm.weight", ("final_norm", "scale"), "rotate", False)
    with pytest.raises(ValueError, match=r"only the \{i\} \(layer\), \{e\} \(expert\) and \{v\} \(vision block\) "
                                         r"placeholders"):
        Row("model.layers.{i}.{j}.weight", ("layers", "x"), None, True)
    row = Row("model.layers.{i}.mlp.up_proj.weight", ("layers", "mlp", "up_proj", "kernel"), "T", True)
    assert row.name(3) == "model.layers.3.mlp.up_proj.weight"
    assert row.pattern().fullmatch("model.layers.12.mlp.up_proj.weight").group(1) == "12"
    assert row.pattern().fullmatch("model.layers.x.mlp.up_proj.weight") is None


def test_flatten_unflatten_roundtrip():
    tree = {"embed": {"embedding": 1}, "layers": {"attn": {"q_proj": {"kernel": 2, "bias": 3}}}, "empty": {}}
    flat = flatten_tree(tree)
    assert flat == {("embed", "embedding"): 1, ("layers", "attn", "q_proj", "kernel"): 2,
                    ("layers", "attn", "q_proj", "bias"): 3}
    back = unflatten_tree(flat)
    assert back == {k: v for k, v in tree.items() if k != "empty"}
    with pytest.raises(ValueError, match="collides"):
        unflatten_tree({("a", "b"): 1, ("a",): 2})
    with pytest.raises(ValueError, match="goes through leaf"):
        unflatten_tree({("a",): 1, ("a", "b"): 2})


# ----------------------------------------------------------------------------- load


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_load_matches_torch_state_dict(arch, tmp_path):
    model = make_model(arch)
    directory = _save_hf(model, tmp_path / arch)
    out, expected, hf_config = _load(directory)
    state = model.state_dict()
    assert list(out) == list(expected)
    for path, (shape, dtype) in expected.items():
        assert out[path].shape == shape and out[path].dtype == dtype, path
        np.testing.assert_array_equal(out[path], oracle_tensor(state, path, hf_config.num_hidden_layers), err_msg=str(path))
    # every HF tensor was consumed (tied lm_head aside)
    used = {ORACLE_NAMES[p][0].format(i) for p in expected for i in range(hf_config.num_hidden_layers)}
    assert set(state) - used <= {"lm_head.weight"}


def test_load_sharded_checkpoint(tmp_path):
    model = make_model("qwen3", seed=1)
    directory = _save_hf(model, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    out, expected, hf_config = _load(directory)
    state = model.state_dict()
    for path in expected:
        np.testing.assert_array_equal(out[path], oracle_tensor(state, path, hf_config.num_hidden_layers))


def test_load_bf16_checkpoint_exact_and_upcast(tmp_path):
    model = make_model("qwen2", seed=2, dtype=torch.bfloat16)
    directory = _save_hf(model, tmp_path / "bf16", max_shard_size="30KB")
    state = model.state_dict()
    as_bf16, expected, hf_config = _load(directory, dtype=BF16)
    as_f32, _, _ = _load(directory, dtype=np.float32)
    for path in expected:
        ref = oracle_tensor(state, path, hf_config.num_hidden_layers)
        assert as_bf16[path].dtype == BF16 and as_f32[path].dtype == np.float32
        np.testing.assert_array_equal(bits(as_bf16[path]), bits(ref))
        np.testing.assert_array_equal(as_f32[path], ref.astype(np.float32))


def test_load_fp32_checkpoint_into_bf16_rounds_like_torch(tmp_path):
    model = make_model("llama", seed=3)
    directory = _save_hf(model, tmp_path / "f32")
    out, expected, hf_config = _load(directory, override=BF16)
    state_bf16 = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    for path in expected:
        assert out[path].dtype == BF16
        np.testing.assert_array_equal(bits(out[path]), bits(oracle_tensor(state_bf16, path, hf_config.num_hidden_layers)))


def test_load_accepts_shape_dtype_structs(tmp_path):
    jax = pytest.importorskip("jax")
    model = make_model("mistral", seed=4)
    directory = _save_hf(model, tmp_path / "m")
    hf_config = transformers.AutoConfig.from_pretrained(directory)
    expected = {p: jax.ShapeDtypeStruct(s, jax.numpy.bfloat16) for p, (s, _) in expected_for(hf_config).items()}
    out = load_weights(directory, table_for("mistral"), expected, 2)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    for path in expected:
        np.testing.assert_array_equal(bits(out[path]), bits(oracle_tensor(state, path, 2)))


# ----------------------------------------------------------------------------- save


@pytest.mark.parametrize("arch", ["llama_bias", "qwen3", "qwen2"])
def test_save_roundtrip_through_transformers(arch, tmp_path):
    model = make_model(arch, seed=5)
    src = _save_hf(model, tmp_path / "src")
    params, _, hf_config = _load(src)
    config = read_config(src)
    dst = tmp_path / "out"
    table = table_for(config["model_type"])
    returned = save_weights(dst, table, params, hf_config.num_hidden_layers, config, max_shard_bytes=16 * 1024)

    assert returned == dst
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n >= 2 and shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    total = 0
    for shard in shards:
        with safe_open(str(dst / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                assert index["weight_map"][name] == shard
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    assert json.loads((dst / "config.json").read_text()) == config
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temp dir renamed away

    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    want, got = model.state_dict(), reloaded.state_dict()
    assert set(want) == set(got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_save_single_file_bf16_cast_and_subset(tmp_path):
    model = make_model("llama", seed=6)
    src = _save_hf(model, tmp_path / "src")
    params, _, hf_config = _load(src)
    config = read_config(src)
    dst = save_weights(tmp_path / "bf16", table_for("llama"), params, 2, config, dtype="bfloat16")
    assert sorted(os.listdir(dst)) == ["config.json", "model.safetensors"]  # one shard: HF's single-file layout
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    want = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert set(saved) == set(want)
    for name in want:
        assert saved[name].dtype == torch.bfloat16
        assert torch.equal(saved[name], want[name]), name

    # Only tensors present in params are written.
    subset = {p: a for p, a in params.items() if p[0] == "layers" and p[1] == "attn"}
    dst2 = save_weights(tmp_path / "subset", table_for("llama"), subset, 2, config)
    with safe_open(str(dst2 / "model.safetensors"), framework="np") as f:
        names = set(f.keys())
    assert names == {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkvo"}


def test_save_jax_arrays(tmp_path):
    jax = pytest.importorskip("jax")
    model = make_model("qwen3", seed=7)
    src = _save_hf(model, tmp_path / "src")
    params, _, _ = _load(src)
    on_device = {p: jax.numpy.asarray(a) for p, a in params.items()}
    dst = save_weights(tmp_path / "out", table_for("qwen3"), on_device, 2, read_config(src))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(dst)
    for name, t in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], t), name


def test_save_is_atomic_and_guards_existing_target(tmp_path):
    model = make_model("llama", seed=8)
    src = _save_hf(model, tmp_path / "src")
    params, _, _ = _load(src)
    config = read_config(src)
    table = table_for("llama")
    target = tmp_path / "target"

    bad = dict(params)
    bad[("layers", "attn", "q_proj", "lora_a")] = np.zeros((2, 32, 4), np.float32)
    with pytest.raises(ValueError, match=r"(?s)layers\.attn\.q_proj\.lora_a.*merge or drop LoRA"):
        save_weights(target, table, bad, 2, config)
    with pytest.raises(ValueError, match="not JSON serializable"):
        save_weights(target, table, params, 2, {"model_type": "llama", "x": object()})

    class FailsOnLayer1:  # an array whose second layer cannot be fetched (e.g. device lost mid-save)
        shape, dtype = params[("layers", "mlp", "up_proj", "kernel")].shape, np.dtype(np.float32)

        def __getitem__(self, i):
            if i == 1:
                raise RuntimeError("device lost")
            return params[("layers", "mlp", "up_proj", "kernel")][i]

    with pytest.raises(RuntimeError, match="device lost"):
        save_weights(target, table, {**params, ("layers", "mlp", "up_proj", "kernel"): FailsOnLayer1()}, 2, config)
    assert not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]

    save_weights(target, table, params, 2, config)
    with pytest.raises(ValueError, match="overwrite=True"):
        save_weights(target, table, params, 2, config)
    (target / "stale.txt").write_text("old")
    params2 = {p: a * 2 for p, a in params.items()}
    save_weights(target, table, params2, 2, config, overwrite=True)
    assert not (target / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "target"]
    reread = load_weights(target, table, {p: (a.shape, a.dtype) for p, a in params.items()}, 2)
    for p in params:
        np.testing.assert_array_equal(reread[p], params2[p])


def test_layer_and_expert_placeholders_round_trip(tmp_path):
    """A row with {i} and {e}: our array [L, E, in, out] <-> one HF [out, in] tensor per layer and expert."""
    row = Row("model.layers.{i}.mlp.experts.{e}.up_proj.weight", ("layers", "mlp", "experts", "up", "kernel"),
              "transpose", True)
    assert row.axes == ("i", "e") and row.name(1, e=3) == "model.layers.1.mlp.experts.3.up_proj.weight"
    assert row.pattern().fullmatch("model.layers.1.mlp.experts.3.up_proj.weight").group("e") == "3"
    table = (row, Row("model.norm.weight", ("final_norm", "scale"), None, False))
    params = {row.path: np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5),
              ("final_norm", "scale"): np.ones(4, np.float32)}
    dst = save_weights(tmp_path / "moe", table, params, 2, {"model_type": "x"}, num_experts=3)
    from safetensors.numpy import load_file

    on_disk = load_file(dst / "model.safetensors")
    assert len(on_disk) == 7
    np.testing.assert_array_equal(on_disk["model.layers.1.mlp.experts.2.up_proj.weight"], params[row.path][1, 2].T)
    expected = {p: (a.shape, a.dtype) for p, a in params.items()}
    back = load_weights(dst, table, expected, 2, num_experts=3)
    for p in params:
        np.testing.assert_array_equal(back[p], params[p])
    with pytest.raises(ValueError, match=r"must start with num_layers=2, num_experts=4"):
        load_weights(dst, table, expected, 2, num_experts=4)


def _parted_table():
    gate = Row("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", ("layers", "mlp", "gate_up"), "T", True, (0, 2))
    up = Row("model.layers.{i}.mlp.experts.{e}.up_proj.weight", ("layers", "mlp", "gate_up"), "T", True, (1, 2))
    return (up, gate, Row("model.norm.weight", ("final_norm", "scale"), None, False))


def test_a_path_in_parts_takes_each_tensor_into_its_block_of_the_last_axis(tmp_path):
    """Rows with `part` (Qwen3-MoE's gate and up as halves of one [E, H, 2I] weight): gate's [I, H] tensors are
    columns :I, up's I:, both ways; WeightSlices reads a column slice within one part and across both."""
    from bridge import WeightSlices
    from safetensors.numpy import load_file

    table = _parted_table()
    rng = np.random.default_rng(0)
    params = {("layers", "mlp", "gate_up"): rng.normal(size=(2, 3, 4, 10)).astype(np.float32),
              ("final_norm", "scale"): np.ones(4, np.float32)}
    dst = save_weights(tmp_path / "parts", table, params, 2, {"model_type": "x"}, num_experts=3)
    on_disk = load_file(dst / "model.safetensors")
    w = params[("layers", "mlp", "gate_up")]
    assert on_disk["model.layers.1.mlp.experts.2.gate_proj.weight"].shape == (5, 4)
    np.testing.assert_array_equal(on_disk["model.layers.1.mlp.experts.2.gate_proj.weight"], w[1, 2, :, :5].T)
    np.testing.assert_array_equal(on_disk["model.layers.0.mlp.experts.1.up_proj.weight"], w[0, 1, :, 5:].T)
    expected = {p: (a.shape, a.dtype) for p, a in params.items()}
    back = load_weights(dst, table, expected, 2, num_experts=3)
    np.testing.assert_array_equal(back[("layers", "mlp", "gate_up")], w)
    with WeightSlices(dst, table, expected, 2, num_experts=3) as source:
        for index in [(slice(0, 2), slice(1, 3), slice(None), slice(3, 8)), (slice(1, 2), slice(None), slice(1, 3),
                      slice(5, 10)), (slice(None), slice(None), slice(None), slice(0, 4))]:
            np.testing.assert_array_equal(source.read(("layers", "mlp", "gate_up"), index), w[index])
    with pytest.raises(ValueError, match=r"does not split into 2 equal parts"):
        load_weights(dst, table, {**expected, ("layers", "mlp", "gate_up"): ((2, 3, 4, 11), np.float32)}, 2,
                     num_experts=3)


def test_a_path_in_parts_needs_every_part_once():
    from bridge.mappings import validate_table

    gate, up, norm = _parted_table()[1], _parted_table()[0], _parted_table()[2]
    with pytest.raises(ValueError, match=r"path \('layers', 'mlp', 'gate_up'\) mapped twice: .*one row per part"):
        validate_table((gate, norm))  # up's half has no row
    with pytest.raises(ValueError, match=r"mapped twice"):
        validate_table((gate, Row(up.hf, up.path, None, True, (1, 2)), norm))  # two transforms
    with pytest.raises(ValueError, match=r"mapped twice"):
        validate_table((gate, Row(up.hf, up.path, "T", True), norm))  # one row whole, one in part
    with pytest.raises(ValueError, match=r"Row.part must be None or \(k, n\)"):
        Row(up.hf, up.path, "T", True, (2, 2))
    assert validate_table((up, gate, norm))
