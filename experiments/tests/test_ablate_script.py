"""experiments/probes/ablate_step.py (the one-process ablation tool used to choose defaults on the GPU) on a tiny
model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_variants_train_the_same_model_and_record_memory(tmp_path):
    from experiments.probes.ablate_step import parse_variant
    from scripts.bench.models import save_random_model
    from scripts.bench.workloads import get_workload

    assert parse_variant("offload+unroll+dsf@128") == (
        "offload", {"xla_gpu_enable_dynamic_slice_fusion": True}, 128, True, "auto")
    assert parse_variant("offload+xscan") == ("offload", {}, None, False, "explicit")
    with pytest.raises(SystemExit, match="unknown options"):
        parse_variant("none+bogus")

    model_dir = tmp_path / "model"
    save_random_model(get_workload("tiny_llama").shape, str(model_dir), "cpu")
    out = tmp_path / "ablate.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    subprocess.run([sys.executable, "-m", "experiments.probes.ablate_step", "--model-dir", str(model_dir),
                    "--workload", "tiny_llama", "--steps", "3", "--warmup", "1",
                    "--variants", "none;none+unroll;full@64;offload+xscan", "--out", str(out)],
                   check=True, env=env, capture_output=True, timeout=300)
    res = json.loads(out.read_text())["variants"]
    assert set(res) == {"none", "none+unroll", "full@64", "offload+xscan"}
    for rec in res.values():
        assert rec["status"] == "ok", rec
        assert len(rec["losses"]) == 3 and rec["median_step_s"] > 0
        assert rec["memory"]["argument_size_in_bytes"] > 0
    # Every variant starts from the same LoRA init and data: the same model, so the same losses (fp32 rounding).
    first = [rec["losses"] for rec in res.values()]
    for losses in first[1:]:
        assert losses == pytest.approx(first[0], rel=1e-4)
