"""`eval_generate_prompts`: each evaluation logs greedy completions of the model as trained so far."""

from __future__ import annotations

from pathlib import Path

import jaxft
from jaxft.data.formatting import load_tokenizer
from jaxft.train import TrainConfig, read_metrics, train

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Sort these numbers: 5, 3, 9", "Reverse the word: jaxft"]


def test_samples_are_logged_at_each_eval_and_match_the_exported_adapter(tmp_path):
    lines = (REPO / "examples/data/train.jsonl").read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join(lines[:64]) + "\n")
    (tmp_path / "eval.jsonl").write_text("\n".join(lines[64:72]) + "\n")
    cfg = TrainConfig(model_name_or_path=str(REPO / "examples/tiny-llama"), dataset=str(tmp_path / "train.jsonl"),
                      eval_dataset=str(tmp_path / "eval.jsonl"), output_dir=str(tmp_path / "out"),
                      max_seq_length=256, per_device_train_batch_size=2, max_steps=4, logging_steps=2, eval_steps=2,
                      learning_rate=5e-3, bf16=False, disable_tqdm=True, report_to="none", lora_r=4,
                      eval_generate_prompts=PROMPTS, eval_generate_max_new_tokens=12)
    result = train(cfg)
    samples = {r["step"]: r["samples"] for r in read_metrics(result.metrics_path) if "samples" in r}
    assert sorted(samples) == [0, 2, 4]
    assert all([s["prompt"] for s in v] == PROMPTS for v in samples.values())

    tokenizer = load_tokenizer(REPO / "examples/tiny-llama")
    base = jaxft.from_pretrained(REPO / "examples/tiny-llama", dtype="float32")
    assert [s["completion"] for s in samples[0]] == jaxft.generate(
        base, tokenizer, PROMPTS, max_new_tokens=12, chat_template=True)
    tuned = jaxft.load_adapter(base, result.adapter_dir)
    assert [s["completion"] for s in samples[4]] == jaxft.generate(
        tuned, tokenizer, PROMPTS, max_new_tokens=12, chat_template=True)
    assert samples[4] != samples[0]  # lr 5e-3 for 4 steps moves the greedy tokens of this tiny model
