"""experiments/probes/max_context.py: the search finds the exact longest row against a known memory limit (synthetic
loads, and a tiny model's compiled step under an injected device budget), the real step runs on random weights, auto's
row and Unsloth's derived row follow their definitions."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest

from experiments.probes import max_context as mc
from scripts.bench.workloads import SHAPES


def _truth(load, g, t_min, t_max):
    fitting = [t for t in range(t_min, t_max + 1, g) if load(t) <= 1.0]
    return max(fitting) if fitting else None


def _nested_load(t: int) -> float:
    """remat offload with nested blocks sized to the host (32 layers, 8 KiB a token per layer input, 113 GiB of
    host, 126 GiB of device): the host load drops where the block grows, the device load jumps up there."""
    stream, host, device = 8192 * t, 113 * 2**30, 126 * 2**30
    k = next((k for k in range(1, 33) if math.ceil(32 / k) * stream <= host), 32)
    return max(math.ceil(32 / k) * stream / host, (15e9 + t * 120e3 + k * stream) / device)


@pytest.mark.parametrize("name,load", [
    ("nested", _nested_load),  # falls between probes on both sides of a jump: no secant root ahead there
    ("affine", lambda t: (3e9 + 2.6e5 * t) / 100e9),
    ("quadratic", lambda t: (1e9 + 4e4 * t + 0.9 * t * t) / 60e9),
    ("steps", lambda t: (2e9 + 1e9 * (t // 5000)) / 40e9),  # piecewise constant: the secant alone stalls
    ("nothing", lambda t: 2.0),
    ("everything", lambda t: 0.5),
])
@pytest.mark.parametrize("start", [1024, 200_000, 1_000_000])
def test_search_finds_the_exact_boundary(name, load, start):
    g, t_min, t_max = 1024, 1024, 1 << 20
    calls = []
    result = mc.search_max(lambda t: calls.append(t) or load(t), start, g, t_min=t_min, t_max=t_max,
                           max_probes=40, slope=2.6e5 / 100e9)
    assert result.best == _truth(load, g, t_min, t_max)
    assert result.exact
    assert len(calls) == len(set(calls)) <= 40  # never the same length twice
    assert all(t % g == 0 and t_min <= t <= t_max for t in calls)
    if name == "nested":
        assert len(calls) <= 14
    if name == "affine":
        assert len(calls) <= 4  # secant steps on an affine load: the guess, the line, the two sides


def test_search_stopped_early_reports_a_consistent_bracket():
    load = lambda t: (1e9 + 4e4 * t + 0.9 * t * t) / 60e9  # noqa: E731
    calls = []
    result = mc.search_max(lambda t: calls.append(t) or load(t), 4096, 1024, t_min=1024, t_max=1 << 20,
                           max_probes=40, should_stop=lambda: len(calls) >= 2)
    assert len(calls) == 2 and result.stopped == "deadline" and not result.exact
    truth = _truth(load, 1024, 1024, 1 << 20)
    assert result.best is None or result.best <= truth
    assert result.first_failing is None or result.first_failing > truth


def test_search_treats_an_out_of_memory_compile_as_not_fitting():
    result = mc.search_max(lambda t: math.inf if t > 50_000 else t / 60_000, 8192, 1024, t_min=1024,
                           t_max=1 << 20, max_probes=30)
    assert result.best == 50_176 - 1024 and result.exact  # the largest multiple of 1024 <= 50,000


def _tiny_settings(tmp_path, **kw) -> mc.Settings:
    config = dict(SHAPES["tiny-llama"].config_dict(), num_hidden_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return mc.Settings(model_dir=str(tmp_path), granularity=128, t_min=256, t_max=640, host_budget=2**30,
                       mlp_chunk_size=256, dtype="float32", attention="reference", **kw)


@pytest.mark.slow
def test_search_on_a_tiny_model_against_an_injected_device_limit(tmp_path):
    """The device budget is put between the compiled estimates at 384 and 512 tokens, so the answer is 384;
    the real step at that length runs (random weights) within the estimate's budget."""
    settings = _tiny_settings(tmp_path)
    probe = functools.lru_cache(maxsize=None)(lambda s, p, t: mc.probe(s, p, t))  # each length compiled once
    at = {t: probe(settings, "full", t)["device_bytes"] for t in (384, 512)}
    assert at[384] < at[512]
    settings = dataclasses.replace(settings, device_budget=(at[384] + at[512]) // 2)
    seen = []
    result = mc.search_policy(settings, "full", emit=seen.append,
                              probe_fn=lambda s, p, t: probe(dataclasses.replace(s, device_budget=None), p, t))
    assert (result["max_seq"], result["first_failing"], result["exact"]) == (384, 512, True), result
    assert result["limited_by"] == "device" and result["device_bytes"] == at[384]
    assert [r["event"] for r in seen] == ["probe"] * result["probes"] + ["result"]

    step = mc.real_step(settings, "full", 384)
    assert step["ok"] and math.isfinite(step["loss"]) and step["estimate_bytes"] <= settings.device_budget, step


def test_offloaded_bytes_are_counted_on_the_host(tmp_path):
    settings = _tiny_settings(tmp_path)
    cfg = SHAPES["tiny-llama"].hf_config
    stream = 1024 * cfg["hidden_size"] * 4  # one fp32 layer input of 1024 tokens
    assert mc.host_bytes_analytic(mc.make_run(settings, "offload", 1024, probe=True), 1024) == stream
    assert mc.host_bytes_analytic(mc.make_run(settings, "full", 1024, probe=True), 1024) == 0
    # offload+attn keeps attention on the device: the same host bytes as offload
    assert mc.host_bytes_analytic(mc.make_run(settings, "offload+attn", 1024, probe=True), 1024) == stream


def test_nested_offload_sizes_its_blocks_to_the_host_budget(tmp_path):
    """offload_nested (remat offload, remat_block auto): with room for every layer input it is plain offload; with
    room for two of four it runs blocks of two, and the host holds one layer input per block; it trains."""
    settings = _tiny_settings(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=4)))
    stream = 512 * config["hidden_size"] * 4  # one fp32 layer input of 512 tokens
    for room, block in ((4, 1), (3, 2), (2, 2), (1, 4)):
        roomy = dataclasses.replace(settings, host_budget=room * stream)
        run = mc.make_run(roomy, "offload_nested", 512, probe=True)
        assert run.execution.layer_policy(run.model_config, 1, 512, 4).block == block
        assert mc.host_bytes_analytic(run, 512) == -(-4 // block) * stream <= room * stream
    step = mc.real_step(dataclasses.replace(settings, host_budget=2 * stream), "offload_nested", 512)
    assert step["ok"] and math.isfinite(step["loss"]), step


def test_deviceless_needs_a_device_budget_and_no_step():
    for argv in (["--deviceless", "--step-seq", "0"], ["--deviceless", "--device-memory-gb", "100"]):
        with pytest.raises(SystemExit, match="--deviceless: pass --device-memory-gb"):
            mc.main(["--model", "tiny-llama", "--policies", "full", *argv])


def test_auto_row_is_the_longest_candidate_offload_nesting_past_the_host():
    """auto skips what the host cannot hold and nests offload there (jaxft.memory.choice.host_fit): its row is the longest of
    its candidates', offload reaching its nested row, and names the first candidate that reaches it."""
    results = {
        "none": dict(max_seq=36_864, limited_by="device", device_bytes=1, host_bytes=0),
        "offload+attn": dict(max_seq=300_032, limited_by="host", device_bytes=2, host_bytes=3),
        "full": dict(max_seq=331_776, limited_by="device", device_bytes=4, host_bytes=0),
        "offload": dict(max_seq=470_016, limited_by="host", device_bytes=5, host_bytes=6),
        "offload_all": dict(max_seq=2_000_000, limited_by="device", device_bytes=7, host_bytes=8),
    }
    row = mc.auto_row(results)
    assert row["max_seq"] == 470_016 and row["choice"] == "offload"  # offload_all is not an auto candidate
    assert (row["device_bytes"], row["host_bytes"]) == (5, 6)
    results["offload_nested"] = dict(max_seq=923_648, limited_by="device", device_bytes=9, host_bytes=10)
    row = mc.auto_row(results)
    assert (row["max_seq"], row["choice"], row["device_bytes"]) == (923_648, "offload in nested blocks", 9)
    del results["offload"]  # auto runs offload nested where its inputs exceed the host, searched or not
    assert mc.auto_row(results)["choice"] == "offload in nested blocks"
    del results["offload_nested"]
    assert mc.auto_row(results)["choice"] == "full"
    results["full"]["max_seq"] = 300_032  # a tie goes to the earlier candidate, as auto's order does
    assert mc.auto_row(results)["choice"] == "offload+attn"
    # lean_attn, searched under its script name, is auto's LEAN_ATTN (between offload+attn and full)
    results["lean_attn"] = dict(max_seq=331_776, limited_by="host", device_bytes=11, host_bytes=12)
    row = mc.auto_row(results)
    assert (row["max_seq"], row["choice"], row["device_bytes"]) == (331_776, "lean_attn", 11)


def test_lean_attn_is_the_remat_policy_auto_tries():
    from jaxft.memory.policy import AUTO_ORDER, LEAN_ATTN

    assert mc.REMAT_OF["lean_attn"] == (LEAN_ATTN, {}) and LEAN_ATTN in AUTO_ORDER and "lean_attn" in mc.POLICIES
    ex = mc.execution_for(mc.Settings(model_dir=None, host_budget=64 * mc.GIB), "lean_attn", 4096, probe=False)
    assert (ex.remat, ex.host_memory_gb) == (LEAN_ATTN, 64.0)


def test_unsloth_row_solves_the_fitted_line_for_the_budget():
    points = ((16384, 20.0), (32768, 24.0), (65536, 32.0))  # exactly 0.25 GiB per 1k tokens + 16 GiB
    u = mc.unsloth_derived(116 * mc.GIB, points)
    assert u["gib_per_1k_tokens"] == pytest.approx(0.25) and u["intercept_gib"] == pytest.approx(16.0)
    assert u["max_seq"] == 400 * 1024
    assert mc.unsloth_derived(10 * mc.GIB, points)["max_seq"] == 0
    assert "DERIVED" in mc.markdown({}, None, 116 * mc.GIB, 100 * mc.GIB)


def test_a_four_bit_recipe_compiles_its_4bit_base_from_shapes(tmp_path):
    """--recipe examples/bench/qlora.yaml: the probe compiles the step with NF4 frozen linears from the config
    alone, so its arguments are smaller than the bf16 recipe's at the same length (the frozen linears hold 4 bits
    plus block scales instead of 16)."""
    bf16 = _tiny_settings(tmp_path)
    qlora = dataclasses.replace(bf16, recipe=str(mc.ROOT / "examples" / "bench" / "qlora.yaml"))
    run = mc.make_run(qlora, "full", 256, probe=True)
    assert run.quant_config is not None and run.quant_config.quant_type == "nf4"
    dense, four_bit = mc.argument_bytes(mc.make_run(bf16, "full", 256, probe=True)), mc.argument_bytes(run)
    assert four_bit < dense, (four_bit, dense)
    assert mc.probe(qlora, "full", 256)["device_bytes"] > 0
    assert mc.recipe(qlora).quant_config is not None and mc.recipe(bf16).quant_config is None
    with pytest.raises(SystemExit, match="--step-seq 0"):
        mc.main(["--model", "tiny-llama", "--recipe", qlora.recipe, "--policies", "full", "--step-seq", "256"])


def test_unsloth_points_parse_and_feed_the_derived_row():
    points = mc.parse_points("4096:7.0,16384:10.0")
    assert points == ((4096, 7.0), (16384, 10.0))
    assert mc.unsloth_derived(13 * mc.GIB, points)["max_seq"] == 28 * 1024  # 0.25 GiB per 1k + 6 GiB
    assert "4k/16k peaks" in mc.markdown({}, None, 13 * mc.GIB, 100 * mc.GIB, points)
    assert mc.parse_points(None) == mc.UNSLOTH_POINTS
    for bad in ("4096:7.0", "4096-7,8192-8"):
        with pytest.raises(SystemExit, match="--unsloth-points"):
            mc.parse_points(bad)
