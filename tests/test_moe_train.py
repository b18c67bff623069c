"""`jaxft-train`'s `lora_target_parameters` key on a tiny Qwen3-MoE: validated, refused on a model without experts,
and the layer loop it implies. The training run with expert LoRA that exports the expert parameters:
test_moe_example.test_the_example_trains_and_its_adapter_loads_in_peft_with_our_logits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from jaxft.memory.choice import _partial_remat
from jaxft.train import TrainConfig, train
from jaxft.train import TrainConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "examples" / "tiny-llama"
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=3)
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def _model_dir(tmp_path, **config) -> Path:
    """A tiny random Qwen3-MoE with the tiny Llama's tokenizer (same vocabulary size)."""
    out = tmp_path / "base"
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**TINY, **config})).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER / name, out / name)
    return out


def _values(tmp_path, base, **overrides) -> dict:
    values = dict(model_name_or_path=str(base), dataset=str(ROOT / "examples" / "data" / "train.jsonl"),
                  output_dir=str(tmp_path / "run"), bf16=False, max_seq_length=128, per_device_train_batch_size=2,
                  max_steps=12, logging_steps=4, save_steps=12, learning_rate=1e-2, lr_scheduler_type="constant",
                  report_to="none", disable_tqdm=True, lora_r=4, lora_alpha=8, lora_target_modules=["q_proj"],
                  lora_target_parameters=EXPERTS, seed=0)
    return {**values, **overrides}


def _config(tmp_path, base, **overrides) -> TrainConfig:
    return TrainConfig(**_values(tmp_path, base, **overrides))


def test_lora_target_parameters_key_is_validated(tmp_path):
    base = _model_dir(tmp_path)
    cfg = _config(tmp_path, base)
    assert cfg.lora_config.target_parameters == tuple(sorted(EXPERTS))
    assert cfg.to_dict()["lora_target_parameters"] == EXPERTS
    assert _config(tmp_path, base, lora_target_parameters=None).lora_config.target_parameters is None
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({k: v for k, v in cfg.to_dict().items()
                                                      if k != "lora_target_parameters"}))
    cli = load_config(tmp_path / "run.yaml", ["lora_target_parameters=[experts.down_proj, experts.gate_up_proj]"])
    assert cli.lora_config.target_parameters == cfg.lora_config.target_parameters
    with pytest.raises(TrainConfigError, match=r"key 'lora_target_parameters': value \[\] is invalid; give a non-empty"):
        _config(tmp_path, base, lora_target_parameters=[])
    with pytest.raises(TrainConfigError, match=r"key 'lora_target_parameters': value 'experts.down_proj' .* wrong type"):
        _config(tmp_path, base, lora_target_parameters="experts.down_proj")
    with pytest.raises(TrainConfigError, match=r"key 'lora_dropout': value 0.1 must be 0 with target_parameters"):
        _config(tmp_path, base, lora_dropout=0.1)


def test_lora_target_parameters_on_a_model_without_experts_is_one_line_naming_the_key(tmp_path):
    cfg = _config(tmp_path, ROOT / "examples" / "tiny-llama", lora_target_parameters=["experts.down_proj"])
    with pytest.raises(TrainConfigError, match=r"^key 'lora_target_parameters': .*'experts.down_proj': this llama "
                                               r"model has no raw parameters LoRA can target"):
        train(cfg)


def test_auto_layer_loop_scans_experts_on_the_mosaic_kernels(tmp_path):
    """Every call site of a Mosaic GPU kernel compiles on its own (24 unrolled GPT-OSS-20B layers: over 4 minutes on
    the H200), so `layer_loop: auto` without remat scans an MoE model whose experts take those kernels; a dense
    model, or experts on ragged_dot, stay unrolled; an explicit `unroll`, or remat on some layers, are obeyed."""
    from jaxft import Run
    from jaxft.memory.execution import ExecutionConfig
    from jaxft.lora import LoraConfig

    base = _model_dir(tmp_path, num_hidden_layers=4)

    def run(**execution):
        return Run(base, lora_config=LoraConfig(r=4, alpha=8), dtype="bfloat16",
                   execution=ExecutionConfig(**{"remat": "none", **execution}))

    mosaic = run(grouped_matmul_implementation="pallas_mosaic")
    assert mosaic.mosaic_experts and mosaic.execution.resolved_layer_loop == "unroll" and not mosaic.unrolled
    assert run(grouped_matmul_implementation="xla").unrolled  # ragged_dot: one XLA op, deduplicated by XLA
    assert run(grouped_matmul_implementation="pallas_mosaic", layer_loop="unroll").unrolled
    assert run(grouped_matmul_implementation="pallas_mosaic", remat="full", remat_layers=1).unrolled
    assert not run().mosaic_experts  # auto on this CPU: ragged_dot
    dense = Run(ROOT / "examples" / "tiny-llama", lora_config=LoraConfig(r=4, alpha=8),
                execution=ExecutionConfig(remat="none", grouped_matmul_implementation="pallas_mosaic"))
    assert not dense.mosaic_experts and dense.unrolled

    # remat auto: full remat on the first k layers needs them unrolled, so it is not tried there (no compile).
    lines, auto = [], run(grouped_matmul_implementation="pallas_mosaic", remat="auto")
    auto.trials.estimates["none"] = 2**40

    def never(*args, **kwargs):
        raise AssertionError("compiled a partial remat candidate")
    assert _partial_remat(auto._target(), auto.execution, auto.trials, never, never, 2**30, 4, lines.append) == \
        (False, None)
    assert lines == ["remat auto: no full remat on the first layers only (it needs unrolled layers, whose Mosaic GPU "
                     "expert kernels compile for minutes); offload+attn is next"]
    explicit = run(grouped_matmul_implementation="pallas_mosaic", remat="auto", layer_loop="unroll")
    explicit.trials.estimates["none"] = 2**40
    with pytest.raises(AssertionError, match="compiled a partial remat candidate"):  # unrolled as asked: tried
        _partial_remat(explicit._target(), explicit.execution, explicit.trials, never, never, 2**30, 4, lines.append)
    assert (mosaic.layer_loop, run(grouped_matmul_implementation="xla").layer_loop) == ("scan", "unroll")
