"""scripts/fp8_accuracy's protocol without the model: its verdict on the 1% bar from paired per-seed eval losses,
and the prose it trains and evaluates on (the run itself is minutes of CPU: docs/results/fp8_accuracy_smollm2.json)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from scripts.fp8_accuracy import BAR, earlier_runs, paired, recipe, reference_paragraphs


@pytest.mark.parametrize(("fp8", "verdict"), [
    ([2.005, 2.006, 2.004], "pass"),         # +0.25% +- 0.05%: the whole 95% interval inside +-1%
    ([2.04, 2.041, 2.039], "fail"),          # +2%: the whole interval above the bar
    ([1.99, 2.03, 2.0], "undecided"),        # +0.33% +- 1%: the interval straddles the bar
    ([1.95, 1.951, 1.949], "fail"),          # -2.5%: outside the bar on the other side
])
def test_paired_verdict_needs_the_whole_interval_on_one_side_of_the_bar(fp8, verdict):
    out = paired([2.0, 2.0, 2.0], fp8)
    assert out["verdict"] == verdict
    assert out["rel_per_seed"] == pytest.approx([f / 2.0 - 1 for f in fp8])
    assert out["abs_per_seed"] == pytest.approx([f - 2.0 for f in fp8])
    low, high = out["rel_ci95"]
    assert low < out["rel_mean"] < high and out["bar"] == BAR


def test_paired_with_one_seed_cannot_decide():
    out = paired([2.0], [2.001])
    assert math.isnan(out["rel_std"]) and out["verdict"] == "undecided"


def test_reference_paragraphs_are_prose_without_code():
    paras = reference_paragraphs()
    assert len(paras) >= 450 and len(set(paras)) == len(paras)
    assert all(150 <= len(p) <= 700 and p[-1] in ".:" and "\n" not in p and ">>>" not in p for p in paras)
    assert paras == reference_paragraphs()


def test_extend_keeps_earlier_runs_of_the_same_recipe_and_refuses_another(tmp_path):
    args = argparse.Namespace(steps=40, lr=1e-3, batch=4, seq=128, extend=[tmp_path / "a.json"])
    run = {"seed": 3, "eval_loss": 2.5}
    earlier = {"recipe": {**recipe(args), "seeds": [3]}, "data": {"sha256": "abc"},
               "runs": {"bf16": [run], "fp8": [{**run, "eval_loss": 2.51}]}}
    (tmp_path / "a.json").write_text(json.dumps(earlier))
    found = earlier_runs(args, "abc")
    assert found == {("bf16", 3): run, ("fp8", 3): {**run, "eval_loss": 2.51}}
    with pytest.raises(SystemExit, match="another recipe or data"):
        earlier_runs(args, "other data")
    with pytest.raises(SystemExit, match="another recipe or data"):
        earlier_runs(argparse.Namespace(**{**vars(args), "steps": 80}), "abc")
