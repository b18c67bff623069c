"""Runs on 2 host CPU devices, all in one subprocess of tests/two_devices_worker.py (XLA's
--xla_force_host_platform_device_count; JAX fixes its device count when it starts), its results read by each test:
a full fine-tune under FSDP against one device, the same with 8-bit AdamW moments and resumed, and `mesh: auto`
with the per-device estimate it chooses by. (8 devices: test_sharding; 2 processes: test_multiprocess.)"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from test_full_finetune import _tiny_llama
from test_train_fixtures import host_devices_env, make_jsonl, make_tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("two_devices")
    _tiny_llama(d / "full_model")
    make_tiny_model(d / "mesh_auto_model", hidden=64, vocab=512)  # weights large enough to dominate the peak
    make_jsonl(d / "mesh_auto.jsonl", 20)
    return d


@pytest.fixture(scope="module")
def results(workdir):
    out = workdir / "out.json"
    res = subprocess.run([sys.executable, str(REPO / "tests" / "two_devices_worker.py"), str(workdir), str(out)],
                         cwd=REPO, env={**host_devices_env(2), "PYTHONPATH": str(REPO)},  # this checkout's jaxft
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # the worker's process (~30 s) runs in this test's setup
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


def test_fsdp_full_finetune_shards_8bit_moments_and_resumes_exactly(results, workdir):
    """`jaxft-train`'s `train` in full with `optim: adamw_8bit` under {fsdp: 2}. tiny-llama's lm_head [128, 1024] is
    its weight with a last axis of 256s: 8-bit moments, split over the devices as the weight is; every other keeps
    fp32 ones. A new run resumed from the checkpoint of step 2: the same weights, bit for bit."""
    out = workdir / "adam8bit"
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


def test_estimate_and_mesh_auto_on_two_devices(results):
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
    assert r["mesh_lines"][1].startswith("mesh auto: {data: 2, fsdp: 1, tensor: 1} estimated peak") and \
        r["mesh_lines"][1].endswith("does not fit")
    assert r["mesh_lines"][2].startswith("mesh auto: {data: 1, fsdp: 2, tensor: 1}") and \
        r["mesh_lines"][2].endswith("fits: chosen")
    assert r["steps"] == 2
