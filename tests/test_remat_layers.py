"""`remat_layers`: the remat policy on the first N layers only (the steps between no remat and remat on every
layer): same gradients, compiled memory falling with N, the validation lines, and `remat: auto` choosing the
smallest N that fits when no remat does not (where offload+attn comes before or after that N: test_memory_choice,
over made-up compiles)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxft.memory.execution import ExecutionConfig, ExecutionConfigError
from jaxft.memory.policy import AUTO_ORDER
from jaxft.memory import GIB, peak_estimate
from test_remat import assert_grads_match, grads, llama, lora_split
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
        assert_grads_match(*grads(cfg, split, "full", "unroll", remat_layers=k), loss0, g0)


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
    assert run.trials.estimates["none"] == estimates[None] > budget
    assert run.trials.estimates[f"full on {LAYERS} layers"] == estimates[LAYERS]
    assert run.trials.estimates["full on 2 layers"] == estimates[2] <= budget
    assert lines[-1].startswith("remat auto: full on 2 layers estimated peak ") and lines[-1].endswith("fits: chosen")
    probe = [line for line in lines if line.startswith(f"remat auto: full on {LAYERS} layers ")]
    assert len(probe) == 1 and probe[0].endswith("-> fits (probe)")  # measured, not chosen
    assert sum(line.endswith("fits: chosen") for line in lines) == 1
    # The choice as the estimates name it (the end-of-training "estimate vs measured" line reads it; keyed by the
    # bare policy it raised KeyError after a partial choice).
    assert run.remat_choice == ("full on 2 layers", estimates[2])
    run.load()
    assert np.isfinite(float(run.step(_batch(), 0)["loss"]))


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


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("deep") / "model", hidden=64, layers=DEEP)


@pytest.mark.slow
def test_auto_measures_the_saving_on_a_shallow_copy(deep_dir):
    """A 5-layer model whose budget fits full remat on 2 layers, not 1: the per-layer saving comes from a 4-layer
    copy, so the only full-depth programs are "none" and the chosen one (before: also full remat on every
    layer), each compile logs one line, and the run keeps its own depth and the chosen step."""
    from jaxft.memory.policy import AUTO_PROBE_DEPTH, AUTO_PROBE_LAYERS

    full = {}
    for k in (1, 2):
        run = _run(deep_dir, "full", remat_layers=k)
        run.compile(_batch())
        full[k] = peak_estimate(run.memory_analysis())
    budget = (full[1] + full[2]) / 2
    lines = []
    run = _run(deep_dir, "auto", max_memory_gb=budget / GIB)
    assert run.choose_remat(_batch(), log=lines.append) == "full" and run.execution.remat_layers == 2
    assert run.trials.estimates["full on 2 layers"] == full[2] <= budget < full[1] < run.trials.estimates["none"]
    probes = [("full", n, AUTO_PROBE_DEPTH) for n in AUTO_PROBE_LAYERS]
    assert run.trials.compiles == [("none", None, DEEP), *probes, ("full", 2, DEEP)]
    assert set(run.trials.estimates) == {"none", "full on 2 layers"}  # the copy's peaks are probes, not candidates
    few, more = (run.trials.probes[f"full on {n} of a {AUTO_PROBE_DEPTH}-layer copy"] for n in AUTO_PROBE_LAYERS)
    assert few > more > 0
    probe_lines = [line for line in lines if "-layer copy " in line]
    assert len(probe_lines) == 2 and all(line.endswith("-> probe (per-layer saving of full remat)")
                                         for line in probe_lines)
    saves = f"remat auto: full remat saves {(few - more) / (AUTO_PROBE_LAYERS[1] - AUTO_PROBE_LAYERS[0]) / GIB:.3f}"
    assert any(line.startswith(saves) and line.endswith("-> full on 2 layers predicted to fit") for line in lines)
    assert len(lines) == 1 + len(run.trials.compiles) + 1  # the budget, one per compile, the prediction
    assert lines[-1].startswith("remat auto: full on 2 layers estimated peak ") and lines[-1].endswith("fits: chosen")
    # The probes left the run's own state alone: its depth, and the chosen step, which loading and stepping reuse.
    compiled = run._compiled
    assert run.model_config.num_layers == DEEP
    run.load()
    assert np.isfinite(float(run.step(_batch(), 0)["loss"])) and run._compiled is compiled


def test_auto_over_the_layer_scan_skips_partial_remat(model_dir):
    """`layer_loop: scan` has no per-layer remat (remat_layers needs the unrolled loop): when none does not fit,
    auto goes on to the next policy instead of failing on a remat_layers it was not given. (The programs are
    test_fit_allocator_in_the_layer_scan's: compiled once for both through the run's compilation cache.)"""
    run = _run(model_dir, "auto", layer_loop="scan", max_memory_gb=1e-4, frozen_weights="device")
    with pytest.raises(ExecutionConfigError) as info:
        run.choose_remat(_batch(), log=lambda line: None)
    assert info.value.field == "max_memory_gb" and set(run.trials.estimates) == set(AUTO_ORDER)
    assert all(layers is None for _, layers, _ in run.trials.compiles)


# ---------------------------------------------------------------------------------------- the allocator after load

def test_contiguous_room_is_the_larger_of_the_free_block_and_the_limit_left_beside_the_pool():
    from jaxft.memory import contiguous_room

    assert contiguous_room({}) is None  # the CPU reports no pool
    assert contiguous_room({"bytes_limit": 100, "pool_bytes": 70, "largest_free_block_bytes": 10}) == 30
    assert contiguous_room({"bytes_limit": 100, "pool_bytes": 95, "largest_free_block_bytes": 20}) == 20


def _stats(room: int) -> dict[str, int]:
    """memory_stats() of an allocator whose pool leaves `room` bytes below its limit and has no larger free block
    (as a GPU's after loading weights with XLA_PYTHON_CLIENT_PREALLOCATE=false)."""
    return {"bytes_limit": 10 * GIB, "pool_bytes": 10 * GIB - room, "largest_free_block_bytes": room // 2}


def test_fit_allocator_takes_more_remat_when_the_pool_leaves_no_room_for_the_temp(model_dir, estimates):
    """auto chose no remat (the budget fits it); after the load the allocator's pool leaves less than the step's
    temp for one buffer (the Gemma-2-9B packed OOM of docs/benchmarks.md section 16): full remat on the fewest
    layers whose temp fits is compiled and kept, over the weights as placed, and the step runs."""
    lines = []
    run = _run(model_dir, "auto", max_memory_gb=2 * estimates[None] / GIB)
    assert run.choose_remat(_batch(), log=lines.append) == "none"
    run.load()
    temp = {k: None for k in (1, 2)}
    for k in temp:
        probe = _run(model_dir, "full", remat_layers=k)
        probe.compile(_batch())
        temp[k] = probe.memory_analysis()["temp_size_in_bytes"]
    none_temp = run.memory_analysis()["temp_size_in_bytes"]
    assert none_temp > temp[1] > temp[2]
    room = (temp[1] + temp[2]) // 2  # fits full remat on 2 layers, not on 1
    run.fit_allocator(_batch(), stats=_stats(room), log=lines.append)
    k = run.execution.remat_layers
    # k is predicted from full remat's per-layer saving, then checked by compiling: it fits, and 1 layer did not
    assert run.execution.remat == "full" and 2 <= k <= LAYERS
    assert run.memory_analysis()["temp_size_in_bytes"] <= room
    assert any(line.startswith("allocator: after the load the allocator can place one buffer of ") for line in lines)
    assert any(line.startswith("remat auto: full remat saves ") for line in lines)  # auto had not measured it
    assert lines[-1].startswith(f"remat auto: full on {k} layers temp ") and lines[-1].endswith("fits the allocator: chosen")
    assert run.remat_choice == (f"full on {k} layers", run.trials.estimates[f"full on {k} layers"])
    assert np.isfinite(float(run.step(_batch(), 0)["loss"]))
    run.fit_allocator(_batch(), stats=_stats(10 * GIB), log=lines.append)  # room enough: nothing changes
    assert (run.execution.remat, run.execution.remat_layers) == ("full", k)


def test_fit_allocator_in_the_layer_scan_takes_the_next_scan_policy_whose_temp_fits(model_dir):
    """auto over the layer scan chose no remat; after the load the pool leaves less room than its temp but more
    than offload+attn's: offload+attn is compiled over the stacked weights as placed and kept, and the step runs.
    With room for none of them, each later scan policy is compiled once, then the one-line error on the key."""
    temps = {}
    for policy in AUTO_ORDER:
        probe = _run(model_dir, policy, layer_loop="scan")
        probe.compile(_batch())
        temps[policy] = probe.memory_analysis()["temp_size_in_bytes"]
    assert temps["none"] > temps["offload+attn"] > 0
    lines = []
    run = _run(model_dir, "auto", layer_loop="scan", max_memory_gb=1000.0)
    assert run.choose_remat(_batch(), log=lines.append) == "none" and not run.unrolled
    run.load()
    room = (temps["none"] + temps["offload+attn"]) // 2
    run.fit_allocator(_batch(), stats=_stats(room), log=lines.append)
    assert (run.execution.remat, run.execution.remat_layers, run.unrolled) == ("offload+attn", None, False)
    assert run.memory_analysis()["temp_size_in_bytes"] == temps["offload+attn"] <= room
    assert lines[-1].startswith("remat auto: offload+attn temp ") and lines[-1].endswith("fits the allocator: chosen")
    assert run.remat_choice == ("offload+attn", run.trials.estimates["offload+attn"])
    assert np.isfinite(float(run.step(_batch(), 0)["loss"]))
    compiled = len(run.trials.compiles)
    with pytest.raises(ExecutionConfigError) as info:
        run.fit_allocator(_batch(), stats=_stats(1024), log=lines.append)
    assert run.trials.compiles[compiled:] == [(p, None, LAYERS) for p in AUTO_ORDER[2:]]
    assert all(line.endswith("does not fit the allocator") for line in lines[-2:])
    assert info.value.field == "max_memory_gb" and "\n" not in str(info.value)


def test_fit_allocator_names_the_fix_when_the_step_cannot_be_rechosen(model_dir):
    """A policy the user set (not auto): its temp does not fit the pool's room -> one line on key max_memory_gb
    with the numbers and the fixes, instead of the allocator's out-of-memory at the first step."""
    run = _run(model_dir, "full", layer_loop="scan")
    run.compile(_batch())
    run.load()
    with pytest.raises(ExecutionConfigError) as info:
        run.fit_allocator(_batch(), stats=_stats(1024))
    text = str(info.value)
    assert text.startswith("key 'max_memory_gb': after the load the allocator can place one buffer of 0.000 GiB "
                           "(pool 10.000 GiB of its 10.000 GiB limit") and "\n" not in text
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=true" in text and "below the step's temp" in text
    with pytest.raises(RuntimeError, match="before Run.load"):
        _run(model_dir, "none").fit_allocator(_batch(), stats=_stats(1024))


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
