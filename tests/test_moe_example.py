"""The MoE example (examples/moe.yaml on examples/tiny-qwen3-moe): the committed model is what
scripts/make_moe_example.py writes, and the example's recipe trains through `jaxft-train`'s path into a PEFT adapter
with the expert parameters that PEFT loads unchanged, giving jaxft's logits at 512 tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import peft
import pytest
from safetensors.numpy import load_file

import jaxft
from jaxft import lora
from jaxft.train import load_config, train
from lora_helpers import hf_model_fp32, jax_logits, rel_err, torch_logits
from scripts import make_moe_example

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "moe.yaml"
MODEL = ROOT / "examples" / "tiny-qwen3-moe"


def test_the_committed_model_is_what_the_script_makes(tmp_path, monkeypatch):
    """Same tensors, config (but the writing transformers' version) and tokenizer files. The script's `main` runs
    in-process (its weights come from numpy's seeded generator, so no state of this process reaches them)."""
    monkeypatch.chdir(ROOT)  # the script's tokenizer path is relative to the repo root, as it runs there
    make_moe_example.main(["--model-dir", str(tmp_path / "m")])
    made, committed = load_file(tmp_path / "m" / "model.safetensors"), load_file(MODEL / "model.safetensors")
    assert sorted(made) == sorted(committed) and len(made) > 20
    for name, value in committed.items():
        np.testing.assert_array_equal(made[name], value, err_msg=name)
    config = lambda d: {k: v for k, v in json.loads((d / "config.json").read_text()).items()  # noqa: E731
                        if k != "transformers_version"}
    assert config(tmp_path / "m") == config(MODEL)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "m" / name).read_bytes() == (MODEL / name).read_bytes(), name


@pytest.mark.slow
def test_the_example_trains_and_its_adapter_loads_in_peft_with_our_logits(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repo root, as `jaxft-train` runs it
    cfg = load_config(EXAMPLE, [f"output_dir={tmp_path / 'run'}", "max_steps=6", "logging_steps=2",
                                "eval_steps=100", "save_steps=6", "disable_tqdm=true"])
    assert cfg.lora_config.target_parameters == ("experts.down_proj", "experts.gate_up_proj")
    result = train(cfg)
    losses = [r["loss"] for r in map(json.loads, result.metrics_path.read_text().splitlines()) if "loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    assert sorted(json.loads((result.adapter_dir / "adapter_config.json").read_text())["target_parameters"]) == \
        ["experts.down_proj", "experts.gate_up_proj"]
    ids = np.random.default_rng(0).integers(4, 1024, (1, 512))
    ours = jax_logits(lora.load_adapter(jaxft.from_pretrained(MODEL, dtype="float32"), result.adapter_dir), ids)
    assert rel_err(ours, torch_logits(hf_model_fp32(MODEL), ids)) > 1e-2, "the adapter must change the logits"
    reference = peft.PeftModel.from_pretrained(hf_model_fp32(MODEL), result.adapter_dir).eval()
    assert rel_err(torch_logits(reference, ids), ours) < 1e-5
