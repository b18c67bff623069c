"""`remat_layers`: the remat policy on the first N layers only (the steps between no remat and remat on every
layer): same gradients, compiled memory falling with N, the validation lines, and `remat: auto` choosing the
smallest N that fits when no remat does not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxft.execution import ExecutionConfig, ExecutionConfigError
from jaxft.run import GIB, peak_estimate
from test_remat import grads, llama, lora_split
from test_remat_auto import _batch, _run
from test_train_fixtures import make_tiny_model

LAYERS = 4
DATA = str(Path(__file__).resolve().parents[1] / "examples" / "data" / "train.jsonl")


def test_remat_on_some_layers_gives_the_gradients_of_no_remat():
    """fp32: to 2e-6 of each gradient's largest entry, the bound of tests/test_remat.py (the checkpointed
    layers fuse differently, so a few fp32 sums round in another order)."""
    cfg = llama(layers=3)
    split = lora_split(cfg)
    loss0, g0 = grads(cfg, split, "none", "unroll")
    for k in (1, 2):
        loss, g = grads(cfg, split, "full", "unroll", remat_layers=k)
        assert abs(loss - loss0) <= 1e-6 * abs(loss0)
        assert len(g) == len(g0) > 0
        for a, b in zip(g, g0):
            scale = float(np.max(np.abs(b)))
            assert scale > 0
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-6 * scale)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(remat="full", remat_layers=-1), "key 'remat_layers': value -1 must be an integer >= 0"),
    (dict(remat="full", remat_layers=True), "key 'remat_layers': value True must be an integer >= 0"),
    (dict(remat="none", remat_layers=2), "key 'remat_layers': is set (2) but remat is 'none'"),
    (dict(remat="auto", remat_layers=2), "key 'remat_layers': is set (2) but remat is 'auto'"),
    (dict(remat="full", remat_layers=2, layer_loop="scan"), "key 'remat_layers': needs the unrolled layer loop"),
])
def test_bad_remat_layers_get_one_line_naming_the_key(kwargs, needle):
    with pytest.raises(ExecutionConfigError) as info:
        ExecutionConfig(**kwargs)
    assert str(info.value).startswith(needle) and "\n" not in str(info.value)


def test_the_flat_keys_reach_the_execution_config(model_dir, tmp_path):
    from jaxft.train import TrainConfig

    cfg = TrainConfig(model_name_or_path=str(model_dir), dataset=DATA, output_dir=str(tmp_path / "o"), remat="full", remat_layers=3,
                      offload_transfer="explicit")
    assert (cfg.execution.remat_layers, cfg.execution.offload_transfer) == (3, "explicit")
    with pytest.raises(Exception, match="key 'offload_transfer': value 'eager' is not one of"):
        TrainConfig(model_name_or_path=str(model_dir), dataset=DATA, output_dir=str(tmp_path / "o"), offload_transfer="eager")


def test_auto_loop_unrolls_under_remat_on_some_layers():
    assert ExecutionConfig(remat="full", remat_layers=3).resolved_layer_loop == "unroll"
    assert ExecutionConfig(remat="full").resolved_layer_loop == "scan"
    # offload_stream's host copies take the explicit transfer, which runs on unrolled layers only
    assert ExecutionConfig(remat="offload_stream").resolved_layer_loop == "unroll"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("partial") / "model", hidden=64, layers=LAYERS)


@pytest.fixture(scope="module")
def estimates(model_dir):
    out = {}
    for k in (None, 1, 2, LAYERS):
        run = _run(model_dir, "none" if k is None else "full", **({} if k is None else dict(remat_layers=k)))
        run.compile(_batch())
        out[k] = peak_estimate(run.memory_analysis())
    return out


def test_memory_falls_with_each_rematerialised_layer(estimates):
    assert estimates[None] > estimates[1] > estimates[2] > estimates[LAYERS] > 0


def test_auto_takes_the_fewest_layers_that_fit_when_no_remat_does_not(model_dir, estimates):
    budget = (estimates[2] + estimates[1]) / 2  # fits with 2 layers rematerialised, not with 1
    lines = []
    run = _run(model_dir, "auto", max_memory_gb=budget / GIB)
    chosen = run.choose_remat(_batch(), log=lines.append)
    assert (chosen, run.execution.remat, run.execution.remat_layers) == ("full", "full", 2)
    assert run.remat_estimates["none"] == estimates[None] > budget
    assert run.remat_estimates[f"full on {LAYERS} layers"] == estimates[LAYERS]
    assert run.remat_estimates["full on 2 layers"] == estimates[2] <= budget
    assert lines[-1].startswith("remat auto: full on 2 layers estimated peak ") and lines[-1].endswith("fits: chosen")
    probe = [line for line in lines if line.startswith(f"remat auto: full on {LAYERS} layers ")]
    assert len(probe) == 1 and probe[0].endswith("-> fits (probe)")  # measured, not chosen
    assert sum(line.endswith("fits: chosen") for line in lines) == 1
    run.load()
    assert np.isfinite(float(run.step(_batch(), 0)["loss"]))
