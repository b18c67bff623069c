"""`jaxft.memory.choice`: the automatic choices as functions over a compile callback, here one that returns made-up
memory analyses (no model is compiled), and what `jaxft-train` checks before it builds its one `Run`
(`jaxft.run.check_config`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

import bridge
from jaxft.config import ModelConfig
from jaxft.lora import LoraConfigError
from jaxft.memory import (GIB, STREAMED, Compiled, ExecutionConfig, ExecutionConfigError, MemoryBudgetError, Target,
                          Trials, choose_remat, fit_allocator)
from jaxft.memory.policy import AUTO_ORDER, LEAN_ATTN
from jaxft.run import Run, check_config
from jaxft.train import TrainConfig

TINY = Path(__file__).resolve().parent.parent / "examples" / "tiny-llama"
PEAKS = {"none": 4.0, "offload+attn": 3.0, LEAN_ATTN: 2.0, "full": 1.5, "offload": 1.2}  # GiB, by policy


def _target(weight_gib: float = 0.5) -> Target:
    return Target(ModelConfig.from_hf(bridge.read_config(TINY)), (jax.devices()[0],), accumulation=1,
                  dtype="float32", mosaic_experts=False, weight_bytes=lambda: int(weight_gib * GIB),
                  host_memory=lambda: (64 * GIB, "a made-up host"), copies_pay=lambda batch: (True, 1.0, 0.0))


def _compiler(calls: list, peaks=PEAKS, streamed_saves: float = 0.0):
    """A compile callback whose step's peak is `peaks[policy]` GiB (all of it temp), less `streamed_saves` GiB
    with the frozen weights on the host; records what it was asked for."""
    def compile(execution: ExecutionConfig, depth=None, mesh=None) -> Compiled:
        calls.append((execution.remat, execution.frozen_weights, depth, mesh))
        gib = peaks[execution.remat] - (streamed_saves if execution.frozen_weights == "host" else 0.0)
        return Compiled({"argument_size_in_bytes": 0, "temp_size_in_bytes": int(gib * GIB)}, 2.0)
    return compile


def _batch(rows: int = 2, seq: int = 64) -> dict[str, np.ndarray]:
    return dict(input_ids=np.zeros((rows, seq), np.int32), segment_ids=np.ones((rows, seq), np.int32))


def _auto(max_gb: float, **execution) -> ExecutionConfig:
    return ExecutionConfig(remat="auto", layer_loop="scan", max_memory_gb=max_gb, host_memory_gb=64, **execution)


def test_choose_remat_takes_the_first_candidate_that_fits_and_compiles_none_after_it():
    """Candidates in AUTO_ORDER until one fits the budget: the decision is the last compile, every compile is in
    the trials with its estimate, and nothing slower than the choice is compiled."""
    calls, lines, trials = [], [], Trials()
    decision = choose_remat(_target(), _auto(2.5), _batch(), _compiler(calls), trials=trials, log=lines.append)
    assert decision.execution.remat == LEAN_ATTN and decision.execution.frozen_weights == "device"
    assert [c[0] for c in calls] == ["none", "offload+attn", LEAN_ATTN]
    assert trials.estimates == {p: int(PEAKS[p] * GIB) for p in ("none", "offload+attn", LEAN_ATTN)}
    assert trials.compiles == [(p, None, 4) for p in ("none", "offload+attn", LEAN_ATTN)]
    assert trials.seconds == 6.0 and trials.choice(decision.execution) == (LEAN_ATTN, int(2.0 * GIB))
    assert lines[-1] == f"remat auto: chose {LEAN_ATTN} (not compiled: full, offload, expected slower)"


def test_choose_remat_streams_the_weights_when_nothing_fits_on_the_device():
    """One device, frozen_weights auto: after every candidate misses the budget with the weights on the device, the
    same candidates again with them streamed from the host, named with the suffix."""
    calls, trials = [], Trials()
    decision = choose_remat(_target(), _auto(1.0), _batch(), _compiler(calls, streamed_saves=2.5), trials=trials,
                            log=lambda line: None)
    assert decision.execution.remat == "offload+attn" and decision.execution.frozen_weights == "host"
    assert [c[:2] for c in calls] == [(p, "device") for p in AUTO_ORDER] + [("none", "host"), ("offload+attn", "host")]
    assert trials.choice(decision.execution) == ("offload+attn" + STREAMED, int(0.5 * GIB))


def test_choose_remat_refuses_in_one_line_naming_the_key_and_the_smallest_estimate():
    trials = Trials()
    with pytest.raises(MemoryBudgetError) as info:
        choose_remat(_target(), _auto(0.5, frozen_weights="device"), _batch(), _compiler([]), trials=trials,
                     log=lambda line: None)
    assert str(info.value) == ("key 'max_memory_gb': no remat policy fits in 0.500 GiB (max_memory_gb): the smallest "
                               "estimate is offload at 1.200 GiB; raise max_memory_gb, or lower "
                               "per_device_train_batch_size / max_seq_length")
    assert set(trials.estimates) == set(AUTO_ORDER)  # the caller keeps what was compiled past the refusal
    # frozen_weights auto, one device: every candidate both ways, the smallest named with the suffix
    with pytest.raises(MemoryBudgetError) as info:
        choose_remat(_target(), _auto(0.5), _batch(), _compiler([], streamed_saves=0.5), trials=trials,
                     log=lambda line: None)
    assert set(trials.estimates) == set(AUTO_ORDER) | {p + STREAMED for p in AUTO_ORDER} and "\n" not in str(info.value)
    assert str(info.value).startswith("key 'max_memory_gb': no remat policy fits in 0.500 GiB (max_memory_gb): the "
                                      f"smallest estimate is offload{STREAMED} at 0.700 GiB; ")


def test_fit_allocator_takes_the_next_scan_policy_whose_temp_fits_the_room():
    """After the load: the step's temp is over the allocator's room, so the scan policies after the chosen one are
    compiled in turn until one's temp fits; a device that reports no pool (the CPU) changes nothing."""
    calls, trials = [], Trials(estimates={"offload+attn": int(3 * GIB)})
    chosen = _auto(3.5).replace(remat="offload+attn")
    stats = {"bytes_limit": int(10 * GIB), "pool_bytes": int(9 * GIB), "largest_free_block_bytes": int(1.6 * GIB)}
    decision = fit_allocator(_target(), chosen, _batch(), {"temp_size_in_bytes": int(3 * GIB)}, stats,
                             _compiler(calls), trials=trials, log=lambda line: None)
    assert decision.execution.remat == "full" and [c[0] for c in calls] == [LEAN_ATTN, "full"]
    streamed = fit_allocator(_target(), chosen.replace(frozen_weights="host"), _batch(),
                             {"temp_size_in_bytes": int(3 * GIB)}, stats, _compiler([]), trials=trials,
                             log=lambda line: None).execution
    assert trials.choice(streamed) == ("full" + STREAMED, int(1.5 * GIB))  # named as the choice it reports
    assert fit_allocator(_target(), chosen, _batch(), {"temp_size_in_bytes": int(3 * GIB)}, {},
                         _compiler(calls)).execution is chosen


def _layered(layers: int) -> ModelConfig:
    """The tiny test models' shape (hidden 64: on a 512-token document attention outweighs a layer's projections)."""
    return ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=layers,
                       num_heads=4, num_kv_heads=2, head_dim=16)


def _by_layers(calls: list, none: dict[int, float], per_layer: float, peaks: dict[str, float]):
    """A compile callback for the unrolled loop: "none" peaks at `none[depth]` GiB, full remat on the first k
    layers (every layer when remat_layers is None) `per_layer` GiB less per layer, other policies at `peaks`."""
    def compile(execution: ExecutionConfig, depth=None, mesh=None) -> Compiled:
        calls.append((execution.remat, execution.remat_layers, depth))
        d = depth or max(none)
        gib = none[d] - per_layer * (execution.remat_layers or d) if execution.remat == "full" else \
            none[d] if execution.remat == "none" else peaks[execution.remat]
        return Compiled({"argument_size_in_bytes": 0, "temp_size_in_bytes": int(gib * GIB)}, 1.0)
    return compile


def _one_document(t: int = 512) -> dict[str, np.ndarray]:
    return dict(input_ids=np.zeros((1, t), np.int32), segment_ids=np.ones((1, t), np.int32))


def test_choose_remat_takes_offload_attn_where_full_remat_on_k_layers_would_recompute_more():
    """Full remat on 2 of the 4 layers fits the budget, and so does offload+attn: on one 512-token document 2 layers
    of full remat recompute more than offload+attn (attention included), so auto compiles offload+attn before any k
    and takes it (it took full on 2 layers when the limit was a fixed 3/4 of the layers)."""
    from jaxft.memory.policy import partial_full_limit, recompute_work

    target, rows, calls, lines, trials = dataclasses.replace(_target(), model_config=_layered(4)), \
        _one_document(), [], [], Trials()
    assert partial_full_limit(recompute_work(target.model_config, rows["segment_ids"])) == 1
    execution = ExecutionConfig(remat="auto", layer_loop="auto", max_memory_gb=3.1, host_memory_gb=64)
    decision = choose_remat(target, execution, rows, _by_layers(calls, {4: 4.0}, 0.6, {"offload+attn": 2.0}),
                            trials=trials, log=lines.append)
    assert decision.execution.remat == "offload+attn" and decision.execution.remat_layers is None
    # no model deeper than the probe copy: the per-layer saving from full remat on all 4 layers, a probe
    assert trials.compiles == [("none", None, 4), ("full", 4, 4), ("offload+attn", None, 4)]
    assert any(line.startswith("remat auto: full on 2 layers recomputes more than offload+attn on this batch (at "
                               "most 1 of the 4 layers do not)") for line in lines)
    assert lines[-2].startswith("remat auto: offload+attn estimated peak ") and lines[-2].endswith("fits: chosen")


def test_choose_remat_comes_back_to_k_layers_when_offload_attn_does_not_fit():
    """A 5-layer model (deeper than the probe copy: the per-layer saving from two compiles of the copy) on the same
    document, a budget that offload+attn and LEAN_ATTN miss and full remat on 4 layers fits: auto comes back to the
    4 layers it passed over, not to full remat on every layer (the next policy of AUTO_ORDER)."""
    from jaxft.memory.policy import AUTO_PROBE_DEPTH, AUTO_PROBE_LAYERS, partial_full_limit, recompute_work

    target, rows, calls, lines, trials = dataclasses.replace(_target(), model_config=_layered(5)), \
        _one_document(), [], [], Trials()
    assert partial_full_limit(recompute_work(target.model_config, rows["segment_ids"])) < 4
    execution = ExecutionConfig(remat="auto", layer_loop="auto", max_memory_gb=2.5, host_memory_gb=64)
    # the copy's intercept is not the model's (only its slope is used): 4.2 - 0.5 * 4 = 2.2 fits, 3 layers do not
    compile = _by_layers(calls, {5: 4.2, AUTO_PROBE_DEPTH: 3.7}, 0.5, {"offload+attn": 3.0, LEAN_ATTN: 2.8})
    decision = choose_remat(target, execution, rows, compile, trials=trials, log=lines.append)
    assert decision.execution.remat == "full" and decision.execution.remat_layers == 4
    assert trials.choice(decision.execution) == ("full on 4 layers", int((4.2 - 0.5 * 4) * GIB))
    probes = [("full", n, AUTO_PROBE_DEPTH) for n in AUTO_PROBE_LAYERS]
    assert trials.compiles == [("none", None, 5), *probes, ("offload+attn", None, 5), (LEAN_ATTN, None, 5),
                               ("full", 4, 5)]
    assert any(line.startswith("remat auto: full on 4 layers recomputes more than offload+attn on this batch")
               for line in lines)
    assert lines[-1].startswith("remat auto: full on 4 layers estimated peak ") and lines[-1].endswith("fits: chosen")


def test_run_is_no_mixin():
    assert Run.__mro__ == (Run, object)


def _config(tmp_path: Path, **keys) -> TrainConfig:
    (tmp_path / "d.jsonl").write_text('{"text": "a b c"}\n')
    return TrainConfig(model_name_or_path=str(TINY), dataset=str(tmp_path / "d.jsonl"),
                       output_dir=str(tmp_path / "out"), **keys)


def test_check_config_refuses_what_a_run_would_before_any_run_is_built(tmp_path):
    """What jaxft-train checks before it reads the data (it then builds its one Run for the planned steps): the
    placement whose batch-parallel size sizes the data, a LoRA target that matches nothing, weights streamed on
    several devices."""
    assert check_config(_config(tmp_path)).batch_parallel == 1
    with pytest.raises(LoraConfigError):
        check_config(_config(tmp_path, lora_target_modules=["no_such_proj"]))
    with pytest.raises(ExecutionConfigError, match="streams one device's weights; this run has 2 devices"):
        check_config(_config(tmp_path, frozen_weights="host", remat="full"), devices=[jax.devices()[0]] * 2)
