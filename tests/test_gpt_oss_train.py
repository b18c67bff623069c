"""`jaxft-train` on a tiny GPT-OSS: attention + expert LoRA (PEFT's `target_parameters`) trains from the run config
(loss falls over 12 steps of packed rows longer than the 128 window) and the exported adapter loads in PEFT."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import peft
import torch
import transformers

from jaxft.train import TrainConfig, train
from lora_helpers import hf_model_fp32

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "examples" / "tiny-llama"
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=1024, bos_token_id=1, eos_token_id=3)


def test_train_run_with_attention_and_expert_lora_lowers_the_loss(tmp_path):
    base = tmp_path / "base"
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(transformers.GptOssConfig(**TINY)).save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER / name, base / name)
    cfg = TrainConfig(model_name_or_path=str(base), dataset=str(ROOT / "examples" / "data" / "train.jsonl"),
                      output_dir=str(tmp_path / "run"), bf16=False, max_seq_length=192, per_device_train_batch_size=1,
                      packing=True, max_steps=12, logging_steps=4, save_steps=12, learning_rate=1e-2,
                      lr_scheduler_type="constant", report_to="none", disable_tqdm=True, lora_r=4, lora_alpha=8,
                      lora_target_modules=["q_proj", "v_proj"],
                      lora_target_parameters=["experts.gate_up_proj", "experts.down_proj"], seed=0)
    result = train(cfg)
    losses = [r["loss"] for r in map(json.loads, result.metrics_path.read_text().splitlines()) if "loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.05, losses
    model = peft.PeftModel.from_pretrained(hf_model_fp32(base), result.adapter_dir)
    wrapped = {n for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.ParamWrapper)}
    assert len(wrapped) == 2 * TINY["num_hidden_layers"]
