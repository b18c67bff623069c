"""Sharding (jaxft.sharding): the mesh from config, logical axes -> mesh axes, FSDP x data parallel training
equal to one device, checkpoints across a mesh change, per-layer weight gathers, and loading by shards.

Multi-device runs happen in one subprocess with 8 host CPU devices (XLA's
--xla_force_host_platform_device_count; JAX fixes its device count when it starts) of tests/sharding_worker.py:
the dense model's training/HLO/loading checks and the `jaxft-train` resume across meshes, a QLoRA step with Pallas
attention, the MoE models, a full fine-tune under FSDP (with 8-bit AdamW moments too) and `mesh: auto`; run once,
its results read by several tests. (2 processes: test_multiprocess.)"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

import bridge
from jaxft.config import ModelConfig
from jaxft.io import param_shapes
from jaxft.lora import LoraConfig, apply_lora
from jaxft.models.build import abstract_model
from jaxft.families import family_for
from jaxft.models.layers import logical_axes
from jaxft.sharding import RULES, MeshConfig, MeshConfigError, partition_spec
from jaxft.train import TrainConfigError, load_config
from test_train_fixtures import host_devices_env, make_jsonl, make_tiny_model

REPO = Path(__file__).resolve().parents[1]
P = jax.sharding.PartitionSpec


# ------------------------------------------------------------------------------------------------ mesh config


def test_mesh_config_resolves_the_rest_and_checks_the_device_count():
    assert MeshConfig().shape(8) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert MeshConfig(data=2, fsdp=-1).shape(8) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert MeshConfig.from_mapping({"fsdp": 4, "data": 2}).shape(8) == {"data": 2, "fsdp": 4, "tensor": 1}
    with pytest.raises(MeshConfigError, match=r"key 'mesh': \{data: 2, fsdp: 2, tensor: 1\} needs 4 devices but "
                                              "there are 8"):
        MeshConfig(data=2, fsdp=2).shape(8)
    with pytest.raises(MeshConfigError, match="8 devices are not a multiple of 3"):
        MeshConfig(data=-1, fsdp=3).shape(8)
    with pytest.raises(MeshConfigError, match="more than one -1"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(MeshConfigError, match=r"fsdp=0 must be a positive integer or -1"):
        MeshConfig(fsdp=0)
    with pytest.raises(MeshConfigError, match=r"tensor=True must be"):
        MeshConfig(tensor=True)
    with pytest.raises(MeshConfigError, match="unknown mesh axis 'fsd'; did you mean 'fsdp'"):
        MeshConfig.from_mapping({"fsd": 2})


def test_train_config_mesh_key_is_validated_with_its_file_line(tmp_path):
    make_tiny_model(tmp_path / "model")
    make_jsonl(tmp_path / "train.jsonl", 4)
    base = dict(model_name_or_path=str(tmp_path / "model"), dataset=str(tmp_path / "train.jsonl"),
                output_dir=str(tmp_path / "out"))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base) + "mesh: {data: 2, fsdp: 0}\n")
    with pytest.raises(TrainConfigError, match=rf"^{path}:4: key 'mesh': fsdp=0 must be a positive integer"):
        load_config(path)
    path.write_text(yaml.safe_dump(base) + "mesh: {data: 2, fsdp: -1}\n")
    assert load_config(path).mesh_config == MeshConfig(data=2, fsdp=-1)
    assert load_config(path, ["mesh={fsdp: 8, data: 1}"]).mesh_config == MeshConfig(data=1, fsdp=8)
    assert load_config(path, ["mesh=null"]).mesh_config == MeshConfig()  # every device on data


# ------------------------------------------------------------------------------------------------ rules


def test_partition_spec_follows_the_rules_and_keeps_indivisible_or_reused_axes_whole():
    mesh = jax.sharding.AbstractMesh((2, 4, 2), ("data", "fsdp", "tensor"))
    assert partition_spec((3, 64, 128), ("layers", "embed", "mlp"), mesh) == P(None, "fsdp", "tensor")
    assert partition_spec((64, 128), ("vocab", "embed"), mesh) == P("tensor", "fsdp")
    assert partition_spec((3, 6, 128), ("layers", "embed", "heads"), mesh) == P(None, None, "tensor")  # 6 % 4
    assert partition_spec((64, 64), ("embed", "embed"), mesh) == P("fsdp", None)  # a mesh axis splits one dim
    assert partition_spec((3, 64), ("layers", "norm"), mesh) == P(None, None)
    assert partition_spec((3, 64, 4), ("layers", "embed", "lora_rank"), mesh) == P(None, "fsdp", None)
    assert partition_spec((64,), None, mesh) == P()


def test_every_parameter_names_its_axes(tmp_path):
    cfg = ModelConfig.from_hf(bridge.read_config(make_tiny_model(tmp_path / "m")))
    from flax import nnx

    from jaxft.models.decoder import Decoder

    model = nnx.eval_shape(lambda: apply_lora(Decoder(cfg, dtype=np.float32, rngs=nnx.Rngs(0)), LoraConfig(r=4)))

    flat = nnx.to_flat_state(nnx.state(model))
    for path, var in flat:
        names = logical_axes(var)
        assert names is not None and len(names) == len(var.shape), (path, names, var.shape)
    axes = {".".join(map(str, p)): logical_axes(v) for p, v in flat}
    assert axes["layers.attn.q_proj.kernel"] == ("layers", "embed", "heads")
    assert axes["layers.attn.k_proj.kernel"] == ("layers", "embed", "kv_heads")
    assert axes["layers.mlp.down_proj.kernel"] == ("layers", "mlp", "embed")
    assert axes["layers.mlp.down_proj.lora_a"] == ("layers", "mlp", "lora_rank")
    assert axes["layers.mlp.down_proj.lora_b"] == ("layers", "lora_rank", "embed")
    assert axes["embed.embedding"] == ("vocab", "embed") and axes["lm_head.kernel"] == ("embed", "vocab")
    assert set(RULES.axes) >= {n for names in axes.values() for n in names}  # every name has a rule


def test_weight_slices_read_what_load_weights_loads(tmp_path):
    path = make_tiny_model(tmp_path / "m", layers=3)
    cfg = ModelConfig.from_hf(bridge.read_config(path))
    expected = param_shapes(abstract_model(cfg, dtype=np.float32))
    table = family_for(cfg.model_type).table
    whole = bridge.load_weights(path, table, expected, cfg.num_layers, np.float32)
    with bridge.WeightSlices(path, table, expected, cfg.num_layers, np.float32) as source:
        for key, index in [(("layers", "attn", "q_proj", "kernel"), (slice(1, 3), slice(8, 24), slice(0, 16))),
                           (("layers", "mlp", "down_proj", "kernel"), (slice(0, 1), slice(32, 64), slice(16, 32))),
                           (("embed", "embedding"), (slice(32, 64), slice(0, 16))),
                           (("lm_head", "kernel"), (slice(16, 32),)),
                           (("layers", "input_norm", "scale"), ())]:
            got = source.read(key, index)
            np.testing.assert_array_equal(got, whole[key][index])
            assert got.dtype == np.float32


# ------------------------------------------------------------------------------------------------ 8 devices


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """tests/sharding_worker.py's results, one process for every model: the dense model's; QLoRA with Pallas
    attention on a model with head_dim 64 (the kernels' smallest); the MoE models; the full fine-tune's Llama with
    biases; `mesh: auto`'s model, wide enough that its weights dominate the peak."""
    from lora_helpers import tiny_qwen3_moe
    from test_full_finetune import _tiny_llama
    from test_gpt_oss import gpt_oss_model
    from test_moe_gmm_choice import QWEN

    d = tmp_path_factory.mktemp("sharding")
    make_tiny_model(d / "model")
    make_jsonl(d / "train.jsonl", 60, seed=0)
    make_tiny_model(d / "pallas", hidden=256)
    tiny_qwen3_moe({**QWEN, "vocab_size": 64}).save_pretrained(d / "qwen3_moe")
    gpt_oss_model(seed=2, num_hidden_layers=2).save_pretrained(d / "gpt_oss")
    _tiny_llama(d / "full_model")
    make_tiny_model(d / "mesh_auto_model", hidden=64, vocab=512)
    make_jsonl(d / "mesh_auto.jsonl", 20)
    out = d / "out.json"
    res = subprocess.run([sys.executable, str(REPO / "tests" / "sharding_worker.py"), str(d), str(out)],
                         cwd=REPO, env={**host_devices_env(8), "PYTHONPATH": str(REPO)},  # this checkout's jaxft
                         capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-4000:]
    return {**json.loads(out.read_text()), "workdir": d}


@pytest.fixture(scope="module")
def worker_result(results):
    return results["dense"]


@pytest.mark.slow
def test_fsdp_and_data_parallel_losses_equal_one_device(worker_result):
    losses = dict(worker_result["losses"])
    one = losses.pop("one_device")
    assert len(one) == 3 and one[-1] < one[0]  # it trains
    assert set(losses) == {"data2_fsdp4", "fsdp8_unrolled"}  # data 8's training: the resume test's second run
    for mesh, got in losses.items():
        np.testing.assert_allclose(got, one, rtol=1e-5, err_msg=mesh)
    # the frozen weights really were split on fsdp (and whole under pure data parallelism)
    assert worker_result["q_proj_spec"] == {"data2_fsdp4": [None, "fsdp", None], "fsdp8_unrolled": ["fsdp", None],
                                            "data8": [None, None, None]}
    assert all(worker_result["lora_replicated"].values())  # LoRA factors (and so Adam's moments) on every device


@pytest.mark.slow
def test_fsdp_step_gathers_each_layers_weights_inside_the_layer_loop(worker_result):
    """Tiny Llama (hidden 32, q/o 32x32, k/v 32x16, MLP 64, 2 layers) on data=2 x fsdp=4, layer scan: each
    per-layer kernel is all-gathered inside the scan (forward, and again for the backward), and no stacked
    [L, in, out] weight is gathered (which would mean all layers at once, before the loop)."""
    gathers = worker_result["all_gathers"]
    kernels = {(32, 32), (32, 16), (32, 64), (64, 32)}
    in_loop = [tuple(g["shape"]) for g in gathers if g["in_loop"]]
    assert kernels <= set(in_loop), gathers
    assert sum(s in kernels for s in in_loop) >= 2 * 7  # q, k, v, o, gate, up, down: forward and backward
    stacked = [g for g in gathers if len(g["shape"]) == 3 and g["shape"][0] == 2 and tuple(g["shape"][1:]) in kernels]
    assert not stacked, stacked


@pytest.mark.slow
def test_sharded_load_reads_each_shard_and_matches_the_unsharded_model(worker_result):
    loaded = worker_result["loaded"]
    assert loaded["logits_max_abs_diff"] < 1e-5
    weights = loaded["weights"]
    want = {  # data=2, fsdp=2, tensor=2: embed halves on fsdp, heads / mlp / vocab halves on tensor
        "layers.attn.q_proj.kernel": ([None, "fsdp", "tensor"], [[2, 16, 16]]),
        "layers.attn.k_proj.kernel": ([None, "fsdp", "tensor"], [[2, 16, 8]]),
        "layers.attn.o_proj.kernel": ([None, "tensor", "fsdp"], [[2, 16, 16]]),
        "layers.mlp.gate_proj.kernel": ([None, "fsdp", "tensor"], [[2, 16, 32]]),
        "layers.mlp.down_proj.kernel": ([None, "tensor", "fsdp"], [[2, 32, 16]]),
        "embed.embedding": (["tensor", "fsdp"], [[32, 16]]),
        "lm_head.kernel": (["fsdp", "tensor"], [[16, 32]]),
        "layers.input_norm.scale": ([None, None], [[2, 32]]),
    }
    for name, (spec, shapes) in want.items():
        assert (weights[name]["spec"], weights[name]["shard_shapes"]) == (spec, shapes), name
    assert all(w["shards_match"] and w["num_shards"] == 8 for w in weights.values()), weights


@pytest.mark.slow
def test_random_weights_are_made_in_place_and_equal_one_devices(worker_result):
    """`Run.init_random` on {fsdp: 4, tensor: 2}: every kernel and the embeddings come out in 8 distinct shards, each
    equal to the matching slice of the same seed's arrays made on one device; LoRA factors and norms replicated;
    the init program's outputs per device are the shards, not the model (tiny Llama: 107 KB whole, of which the
    replicated LoRA factors, norms and scales are about 20 KB)."""
    random = worker_result["random"]
    arrays = random["arrays"]
    assert all(a["shards_match"] for a in arrays.values()), arrays
    split = {k for k, a in arrays.items() if a["num_shards"] == 8}
    kernels = {f"frozen.layers.{m}.{p}.kernel" for m, ps in (("attn", "qkvo"), ("mlp", ("gate", "up", "down")))
               for p in (f"{x}_proj" for x in ps)}
    assert split == kernels | {"frozen.embed.embedding", "frozen.lm_head.kernel"}, split
    assert all(a["num_shards"] == 1 for k, a in arrays.items() if k not in split)
    assert random["output_bytes"] < random["whole_bytes"] / 3, random


@pytest.fixture(scope="module")
def per_device(results):
    return results["per_device"]


@pytest.mark.slow
def test_pallas_attention_on_a_mesh_runs_on_each_devices_rows(per_device):
    """Pallas flash attention (interpreted on the CPU) under data=2 x fsdp=2: no all-gather of activations (before
    `per_device_attention`, q, k and v were gathered to the whole batch, f32[16, 128, heads, 64] here, and every
    device computed every row), and the losses of one device. A model with head_dim 64 (the kernels' smallest);
    its base in 4 bits (the QLoRA test below reads the same run)."""
    out = per_device
    assert out["row_gathers"] == []
    np.testing.assert_allclose(out["losses"]["data2_fsdp2"], out["losses"]["one_device"], rtol=1e-5)


@pytest.mark.slow
def test_qlora_on_a_mesh_splits_the_4bit_bytes_and_equals_one_device(per_device):
    """QLoRA (nf4 base, double-quantised; Pallas attention) under data=2 x fsdp=2, layer scan: one device's losses,
    each device on its own rows (no all-gather of activations); each linear's packed codes and block scales split
    over fsdp along their flat axis (the nested scales and offsets, a few bytes, whole), and all the layer loop
    gathers is those bytes (u8: codes, and the scales' 8-bit codes), never a weight decoded from its shards (f32
    here)."""
    out = per_device
    assert out["row_gathers"] == []
    specs = out["quant_specs"]
    assert set(specs) == {"packed", "absmax", "nested_absmax", "offset"}
    assert all(len(v) == 7 for v in specs.values())  # q, k, v, o, gate, up, down
    assert all(spec == [None, "fsdp"] for name in ("packed", "absmax") for spec in specs[name]), specs
    assert all(not any(spec) for name in ("nested_absmax", "offset") for spec in specs[name]), specs
    assert out["loop_gather_types"] == ["u8"], out
    assert out["losses"]["one_device"][-1] < out["losses"]["one_device"][0]
    np.testing.assert_allclose(out["losses"]["data2_fsdp2"], out["losses"]["one_device"], rtol=1e-5)


@pytest.mark.slow
def test_checkpoint_written_on_one_mesh_resumes_on_another(worker_result):
    """jaxft-train's `train` on data 2 x fsdp 4 (frozen weights split) writes a checkpoint at step 3; resumed from
    it on data 8 (every weight whole on every device; pure data parallelism trains here), 16 rows per step on both
    (2 micro-batches), the run logs the losses of the uninterrupted one."""
    full, resumed = worker_result["resumed"]["fsdp"], worker_result["resumed"]["data"]
    for run in (full, resumed):  # the mesh really spans the 8 devices
        assert len(run["devices"]) == 1 and "x 8 batch-parallel devices" in run["devices"][0], run["devices"]
    full, resumed = ({int(k): v for k, v in run["losses"].items()} for run in (full, resumed))
    assert sorted(full) == [1, 2, 3, 4, 5] and sorted(resumed) == [4, 5]
    np.testing.assert_allclose([resumed[4], resumed[5]], [full[4], full[5]], rtol=1e-5)


# ------------------------------------------------------------------------------------------------ MoE on 8 devices


@pytest.fixture(scope="module")
def moe_result(results):
    return results["moe"]


# Both families on fsdp 4 x tensor 2 (each device routing its own rows; for GPT-OSS, its gate and up interleaved
# along the width tensor splits, with biases); Qwen3-MoE also with the routing global (the families' one code).
MOE_MESHES = {"qwen3_moe": {"fsdp4_tensor2", "data2_fsdp4_global"}, "gpt_oss": {"fsdp4_tensor2"}}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_moe_training_on_a_mesh_equals_one_device(family, moe_result):
    """Qwen3-MoE and GPT-OSS with both expert adapters: 3 LoRA steps on fsdp 4 x tensor 2 give one device's losses,
    each device routing its own rows (moe_dispatch per_device), and so does (Qwen3-MoE) the global routing on
    data 2 x fsdp 4, which sorts every row on every device; the frozen expert stacks are split (on fsdp along the
    hidden width, on tensor along the experts' width), the expert adapters are whole on every device. (Pure data
    parallelism, stacks whole on every device, is the dense model's data 8 above.)"""
    out = moe_result[family]
    losses = dict(out["losses"])
    one = losses.pop("one_device")
    assert len(one) == 3 and len(set(one)) > 1
    meshes = MOE_MESHES[family]
    assert set(losses) == meshes
    for mesh, got in losses.items():
        np.testing.assert_allclose(got, one, rtol=1e-5, err_msg=mesh)
    # Each device sorts its own tokens' slots: 2 of the 8 micro-batch rows x half their tokens on fsdp 4 x tensor 2
    # (the tensor pair splits a row's tokens); the global routing sorts the whole micro-batch's on every device
    # (jaxft.models.moe.per_device).
    k = 2  # both tiny models route each token to 2 experts
    slots = {"fsdp4_tensor2": [2 * 32 * k], "data2_fsdp4_global": [8 * 64 * k]}
    assert out["sorted_slots"] == {m: slots[m] for m in meshes}, out["sorted_slots"]
    # gate_up_proj [L, E, H, 2I]: layers and experts whole, H on fsdp, 2I on tensor
    assert out["expert_spec"] == {"fsdp4_tensor2": [None, None, "fsdp", "tensor"]}, out["expert_spec"]
    assert out["expert_lora_replicated"] and all(out["expert_lora_replicated"].values())


# ------------------------------------------------------------------------------------ full fine-tune, mesh auto


@pytest.mark.slow
def test_full_finetune_on_fsdp_shards_weights_and_adam_state_and_equals_one_device(results):
    """A full fine-tune on {fsdp: 2}: every weight with a hidden ("embed") dimension and its AdamW moments are split
    over fsdp (the rest kept whole), and two steps give one device's losses and weights."""
    got = results["full"]
    np.testing.assert_allclose(got["losses"]["fsdp"], got["losses"]["one"], rtol=1e-5)
    assert got["weights"] < 1e-4  # each step moves a weight by about lr = 1e-2; Adam turns fp32 noise into 2e-5
    split = {path for path, (w, mu, nu, shape) in got["specs"].items() if "fsdp" in w}
    for path, (w, mu, nu, shape) in got["specs"].items():
        assert w == mu == nu, path  # the moments live where their weight does
    # The 7 linear kernels, embeddings and head have a hidden ("embed") dimension, and so have the o_proj and
    # down_proj biases; norms and the other biases do not (kept whole).
    assert {p for p in got["specs"] if "kernel" in p or "embedding" in p} <= split
    assert split - {p for p in split if "kernel" in p or "embedding" in p} == {
        "['layers']['attn']['o_proj']['bias'].value", "['layers']['mlp']['down_proj']['bias'].value"}
    assert len(split) == 11 and len(got["specs"]) > len(split)


@pytest.mark.slow
def test_fsdp_full_finetune_shards_8bit_moments_and_resumes_exactly(results):
    """`jaxft-train`'s `train` in full with `optim: adamw_8bit` under {data: 4, fsdp: 2}. tiny-llama's lm_head
    [128, 1024] is its weight with a last axis of 256s: 8-bit moments, split over fsdp as the weight is; every
    other keeps fp32 ones. A new run resumed from the checkpoint of step 2: the same weights, bit for bit."""
    out = results["workdir"] / "adam8bit"
    a, b = (load_file(out / name / "model" / "model.safetensors") for name in ("whole", "resumed"))
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    # The checkpoint holds the 8-bit state: one block-scale array per moment (lm_head's), beside the codes, and
    # lm_head's codes are split over the devices by its rows, as lm_head is.
    stored = out / "whole" / "checkpoints" / "2" / "opt_state"
    tree = (stored / "_METADATA").read_text()
    assert tree.count("'mu_absmax', '") == tree.count("'nu_absmax', '") == 1, tree
    shardings = {base64.b64decode(k).decode(): json.loads(v)["partition_spec"]
                 for k, v in json.loads((stored / "_sharding").read_text()).items()}
    assert shardings["1.0.mu.lm_head.kernel.value"] == ["fsdp", None], shardings


@pytest.mark.slow
def test_estimate_and_mesh_auto_choose_fsdp_where_data_parallelism_does_not_fit(results):
    """A tiny model's fsdp step holds less per device than its data-parallel step, and with a max_memory_gb between
    the two `mesh: auto` trains on fsdp, saying so. (Its choice logic over made-up compiles: test_mesh_auto.)"""
    r = results["mesh_auto"]
    dp, fsdp = r["estimates"]["dp"], r["estimates"]["fsdp"]
    # fp32 weights of hidden 64, MLP 128, 2 layers, vocab 512 x 2 (embedding, head): ~0.5 MiB; each fsdp
    # device holds about half of them
    weights = 4 * (2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128) + 2 * 512 * 64)
    assert weights < dp["argument_size_in_bytes"] < 2 * weights
    assert fsdp["argument_size_in_bytes"] < 0.75 * dp["argument_size_in_bytes"]
    assert 0 < fsdp["peak"] < dp["peak"] < 2**30
    assert r["mesh_lines"][1].startswith("mesh auto: {data: 8, fsdp: 1, tensor: 1} estimated peak") and \
        r["mesh_lines"][1].endswith("does not fit")
    assert r["mesh_lines"][2].startswith("mesh auto: {data: 4, fsdp: 2, tensor: 1}") and \
        r["mesh_lines"][2].endswith("fits: chosen")
    assert r["steps"] == 2
