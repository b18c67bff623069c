"""`remat_layers`: the remat policy on the first N layers only (the steps between no remat and remat on every
layer): same gradients, the validation lines, and `remat: auto` (and the allocator's re-choice after the load)
taking the smallest N that fits when no remat does not, over made-up compiles (where offload+attn comes before or
after that N: test_memory_choice; a Run's real compiles: test_remat_auto)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from jaxft.memory import GIB, Trials, choose_remat, fit_allocator
from jaxft.memory.execution import ExecutionConfig, ExecutionConfigError
from jaxft.memory.policy import AUTO_ORDER, AUTO_PROBE_DEPTH, AUTO_PROBE_LAYERS, partial_full_limit, recompute_work
from test_memory_choice import _by_layers, _layered
from test_memory_choice import _target as made_up_target
from test_remat import LLAMA, assert_grads_match, grads, lora_split
from test_remat_auto import _batch, _stats
from test_train_fixtures import make_tiny_model

LAYERS = 4
DATA = str(Path(__file__).resolve().parents[1] / "examples" / "data" / "train.jsonl")


def test_remat_on_some_layers_gives_the_gradients_of_no_remat():
    """fp32: to 2e-6 of each gradient's largest entry, the bound of tests/test_remat.py (the checkpointed
    layers fuse differently, so a few fp32 sums round in another order)."""
    split = lora_split(LLAMA)  # 2 layers: the first checkpointed, the second not
    assert_grads_match(*grads(LLAMA, split, "full", "unroll", remat_layers=1), *grads(LLAMA, split, "none", "unroll"))


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

    cfg = TrainConfig(model_name_or_path=str(model_dir), dataset=DATA, output_dir=str(tmp_path / "o"), remat="full",
                      offload_transfer="explicit")
    assert (cfg.execution_config.remat, cfg.execution_config.offload_transfer) == ("full", "explicit")
    with pytest.raises(TypeError, match="remat_layers"):  # remat auto's own setting, not a user key
        TrainConfig(model_name_or_path=str(model_dir), dataset=DATA, output_dir=str(tmp_path / "o"), remat_layers=3)
    with pytest.raises(Exception, match="key 'offload_transfer': value 'eager' is not one of"):
        TrainConfig(model_name_or_path=str(model_dir), dataset=DATA, output_dir=str(tmp_path / "o"), offload_transfer="eager")


def test_auto_loop_unrolls_under_remat_on_some_layers():
    assert ExecutionConfig(remat="full", remat_layers=3).resolved_layer_loop == "unroll"
    assert ExecutionConfig(remat="full").resolved_layer_loop == "scan"
    # the explicit transfer runs on unrolled layers only
    assert ExecutionConfig(remat="offload", offload_transfer="explicit").resolved_layer_loop == "unroll"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("partial") / "model", hidden=64, layers=LAYERS)


# `remat: auto` over remat_layers, as `jaxft.memory.choice` decides it over made-up compiles (test_memory_choice's
# callback: "none" peaks at none[depth] GiB, full remat on k layers `per_layer` GiB less a layer); the real compiles
# of a Run's choice are test_remat_auto's.
def _rows() -> dict[str, np.ndarray]:
    """test_remat_auto's batch ([2, 128] packed rows): full remat on up to 3 of 4 layers recomputes less than
    offload+attn on it (`partial_full_limit`), so auto tries k layers before offload+attn."""
    return _batch()


def _auto_on(layers: int, max_gb: float, **execution):
    target = dataclasses.replace(made_up_target(), model_config=_layered(layers))
    return target, ExecutionConfig(remat="auto", max_memory_gb=max_gb, host_memory_gb=64, **execution)


def test_auto_takes_the_fewest_layers_that_fit_when_no_remat_does_not():
    """4 layers (no deeper than the probe copy): full remat on all 4 is compiled as a probe at full depth (the
    per-layer saving), then the fewest layers predicted to fit, compiled and chosen: 2 (4.0 - 0.6 * 2 = 2.8 GiB
    fits 2.9, one layer's 3.4 does not)."""
    target, execution = _auto_on(LAYERS, 2.9)
    assert partial_full_limit(recompute_work(target.model_config, _rows()["segment_ids"])) >= 2
    calls, lines, trials = [], [], Trials()
    decision = choose_remat(target, execution, _rows(), _by_layers(calls, {LAYERS: 4.0}, 0.6, {}), trials=trials,
                            log=lines.append)
    assert (decision.execution.remat, decision.execution.remat_layers) == ("full", 2)
    assert trials.compiles == [("none", None, LAYERS), ("full", LAYERS, LAYERS), ("full", 2, LAYERS)]
    assert trials.estimates == {"none": int(4.0 * GIB), f"full on {LAYERS} layers": int((4.0 - 0.6 * LAYERS) * GIB),
                                "full on 2 layers": int((4.0 - 0.6 * 2) * GIB)}
    assert lines[-1].startswith("remat auto: full on 2 layers estimated peak ") and lines[-1].endswith("fits: chosen")
    probe = [line for line in lines if line.startswith(f"remat auto: full on {LAYERS} layers ")]
    assert len(probe) == 1 and probe[0].endswith("-> fits (probe)")  # measured, not chosen
    assert sum(line.endswith("fits: chosen") for line in lines) == 1
    # The choice as the estimates name it (the end-of-training "estimate vs measured" line reads it; keyed by the
    # bare policy it raised KeyError after a partial choice).
    assert trials.choice(decision.execution) == ("full on 2 layers", int((4.0 - 0.6 * 2) * GIB))


# ---------------------------------------------------------------------------------------------- shallow probes
DEEP = 5  # deeper than auto's probe copy (jaxft.memory.policy.AUTO_PROBE_DEPTH), so auto measures on the copy


def test_first_layers_cuts_the_per_layer_choices():
    from jaxft.config import ConfigError, ModelConfig

    cfg = ModelConfig(model_type="gemma2", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=5,
                      num_heads=2, num_kv_heads=1, head_dim=16, layer_windows=(24, None, 24, None, 24))
    cut = cfg.first_layers(2)
    assert (cut.num_layers, cut.layer_windows, cut.layer_ropes) == (2, (24, None), ("global", "global"))
    assert cut.replace(num_layers=5, layer_windows=cfg.layer_windows) == cfg  # nothing else changed
    moe = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4,
                      num_heads=2, num_kv_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, layer_mlps=("glu", "glu", "moe", "moe"))
    with pytest.raises(ConfigError, match="no layer of this qwen3_moe model has its family's 'moe' MLP"):
        moe.first_layers(2)  # all dense: no valid copy (auto then compiles full remat at full depth)
    with pytest.raises(ConfigError, match=r"first_layers\(0\) must keep between 1 and num_layers \(4\)"):
        moe.first_layers(0)


def test_auto_measures_the_saving_on_a_shallow_copy():
    """A 5-layer model whose budget fits full remat on 2 layers, not 1: the per-layer saving comes from a 4-layer
    copy, so the only full-depth programs are "none" and the chosen one (before: also full remat on every
    layer), and each compile logs one line. (The copy's intercept is not the model's: only its slope is used.)"""
    target, execution = _auto_on(DEEP, 3.3)
    calls, lines, trials = [], [], Trials()
    compile = _by_layers(calls, {DEEP: 4.2, AUTO_PROBE_DEPTH: 3.7}, 0.5, {})
    decision = choose_remat(target, execution, _rows(), compile, trials=trials, log=lines.append)
    assert (decision.execution.remat, decision.execution.remat_layers) == ("full", 2)
    assert trials.estimates == {"none": int(4.2 * GIB), "full on 2 layers": int((4.2 - 0.5 * 2) * GIB)}
    probes = [("full", n, AUTO_PROBE_DEPTH) for n in AUTO_PROBE_LAYERS]
    assert trials.compiles == [("none", None, DEEP), *probes, ("full", 2, DEEP)]  # the copy's peaks are probes
    few, more = (trials.probes[f"full on {n} of a {AUTO_PROBE_DEPTH}-layer copy"] for n in AUTO_PROBE_LAYERS)
    assert few > more > 0
    probe_lines = [line for line in lines if "-layer copy " in line]
    assert len(probe_lines) == 2 and all(line.endswith("-> probe (per-layer saving of full remat)")
                                         for line in probe_lines)
    saves = f"remat auto: full remat saves {(few - more) / (AUTO_PROBE_LAYERS[1] - AUTO_PROBE_LAYERS[0]) / GIB:.3f}"
    assert saves == "remat auto: full remat saves 0.500"
    assert any(line.startswith(saves) and line.endswith("-> full on 2 layers predicted to fit") for line in lines)
    assert len(lines) == 1 + len(trials.compiles) + 1  # the budget, one per compile, the prediction
    assert lines[-1].startswith("remat auto: full on 2 layers estimated peak ") and lines[-1].endswith("fits: chosen")


def test_auto_over_the_layer_scan_skips_partial_remat():
    """`layer_loop: scan` has no per-layer remat (remat_layers needs the unrolled loop): when none does not fit,
    auto goes on to the next policy instead of failing on a remat_layers it was not given."""
    target, execution = _auto_on(LAYERS, 1e-4, layer_loop="scan", frozen_weights="device")
    trials = Trials()
    peaks = {p: 2.0 for p in AUTO_ORDER}
    with pytest.raises(ExecutionConfigError) as info:
        choose_remat(target, execution, _rows(), _by_layers([], {LAYERS: 4.0}, 0.6, peaks), trials=trials,
                     log=lambda line: None)
    assert info.value.field == "max_memory_gb" and set(trials.estimates) == set(AUTO_ORDER)
    assert trials.compiles == [(p, None, LAYERS) for p in AUTO_ORDER]


# ---------------------------------------------------------------------------------------- the allocator after load

def test_contiguous_room_is_the_larger_of_the_free_block_and_the_limit_left_beside_the_pool():
    from jaxft.memory import contiguous_room

    assert contiguous_room({}) is None  # the CPU reports no pool
    assert contiguous_room({"bytes_limit": 100, "pool_bytes": 70, "largest_free_block_bytes": 10}) == 30
    assert contiguous_room({"bytes_limit": 100, "pool_bytes": 95, "largest_free_block_bytes": 20}) == 20


def test_fit_allocator_takes_more_remat_when_the_pool_leaves_no_room_for_the_temp():
    """auto chose no remat (the budget fits it); after the load the allocator's pool leaves less than the step's
    temp for one buffer (the Gemma-2-9B packed OOM in experiments/LOG.md): full remat's per-layer saving,
    not measured by auto, is measured (full on every layer, a probe), and full remat on the fewest layers whose
    temp fits is compiled and kept: 2 (made-up compiles, as above; over a Run, the layer scan's re-choice is
    test_remat_auto's)."""
    target, execution = _auto_on(LAYERS, 8.0)
    calls, lines, trials = [], [], Trials()
    compile = _by_layers(calls, {LAYERS: 4.0}, 0.6, {})
    chosen = choose_remat(target, execution, _rows(), compile, trials=trials, log=lines.append).execution
    assert chosen.remat == "none" and chosen.unrolls(False)
    room = int(2.9 * GIB)  # fits full remat on 2 layers (2.8 GiB), not on 1 (3.4)
    decision = fit_allocator(target, chosen, _rows(), {"temp_size_in_bytes": int(4.0 * GIB)}, _stats(room), compile,
                             trials=trials, log=lines.append)
    assert (decision.execution.remat, decision.execution.remat_layers) == ("full", 2)
    assert trials.compiles[1:] == [("full", LAYERS, LAYERS), ("full", 2, LAYERS)]
    assert any(line.startswith("allocator: after the load the allocator can place one buffer of ") for line in lines)
    assert any(line.startswith("remat auto: full remat saves 0.600 GiB per layer") for line in lines)
    assert lines[-1].startswith("remat auto: full on 2 layers temp ")
    assert lines[-1].endswith("fits the allocator: chosen")
    assert trials.choice(decision.execution) == ("full on 2 layers", int(2.8 * GIB))
    again = fit_allocator(target, decision.execution, _rows(), {"temp_size_in_bytes": int(2.8 * GIB)},
                          _stats(10 * GIB), compile, trials=trials, log=lines.append)  # room enough: no change
    assert again.execution is decision.execution


# ------------------------------------------------------------------- full remat on k layers against offload+attn
def test_kept_pairs_count_what_a_causal_windowed_mask_keeps():
    """Against the mask itself: packed rows of random document lengths (a run of one id is a document, padding
    included), with and without a window."""
    from kernels_pallas.attention import kept_pairs

    rng = np.random.default_rng(3)
    rows = []
    for _ in range(3):
        lengths = rng.integers(1, 30, 6)
        rows.append(np.repeat(np.arange(len(lengths)) % 2 + np.arange(len(lengths)), lengths)[:60])
    ids = np.stack([np.pad(r, (0, 60 - len(r)), constant_values=0) for r in rows])
    for window in (None, 1, 5, 17):
        i, j = np.arange(60)[:, None], np.arange(60)[None, :]
        keep = (j <= i) & ((i - j < window) if window else True)
        want = sum(int(((row[:, None] == row[None, :]) & keep).sum()) for row in ids)
        assert kept_pairs(ids, window) == want, window


def _llama_8b(**kw):
    from jaxft.config import ModelConfig

    return ModelConfig(**{**dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                 num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128), **kw})


def test_full_remat_pays_on_fewer_layers_as_attention_outweighs_the_projections():
    """Llama-3.1-8B's shape (a config, no weights): one document per row, the layers full remat may take before
    offload+attn recomputes less fall with the row's length (attention grows with its square); packed documents
    of a few hundred tokens attend little, and sliding windows cap what a layer attends. Each limit is the
    definition's largest k, checked one layer either side."""
    from jaxft.memory.policy import partial_full_limit, recompute_work

    def limit(cfg, ids):
        work = recompute_work(cfg, ids)
        k = partial_full_limit(work)
        projections = sum(p for p, _ in work)
        assert sum(p + a for p, a in work[:k]) <= projections
        assert k == len(work) or sum(p + a for p, a in work[:k + 1]) > projections
        return k

    cfg = _llama_8b()
    one_document = [limit(cfg, np.ones((1, t), np.int32)) for t in (4096, 16384, 65536, 262144)]
    assert one_document == sorted(one_document, reverse=True) and len(set(one_document)) == 4
    assert 0 < one_document[-1] and one_document[0] < cfg.num_layers
    packed = np.repeat(np.arange(1, 55), 300)[None, :16384]  # documents of 300 tokens
    assert limit(cfg, packed) > one_document[0]
    windows = cfg.replace(layer_windows=(4096, None) * 16)  # Gemma-2-like alternation
    assert limit(windows, np.ones((1, 65536), np.int32)) > one_document[2]
