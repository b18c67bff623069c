"""Shared builders for the training tests: a tiny Llama + char-level tokenizer saved as an HF directory, tiny
JSONL data, and `jaxft-train` runs on N host CPU devices. (No tests here; `test_train*.py`, `test_cli*.py`,
`test_resume*.py` and the multi-device tests import these.)"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import string
import subprocess
import sys
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list(string.ascii_lowercase + string.digits + " .,:?!-")


def make_tokenizer():
    """A character-level fast tokenizer (one token per character, BOS added, EOS known): ~47 tokens."""
    from tokenizers import Tokenizer, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def make_tiny_model(path: Path, *, seed: int = 0, hidden: int = 32, layers: int = 2, vocab: int = 64) -> Path:
    """Saves a random tiny LlamaForCausalLM (fp32 safetensors) and the char tokenizer to `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # larger than the default 0.02 init, so the loss curve moves visibly in a few steps
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def make_jsonl(path: Path, n: int, *, seed: int = 0, kind: str = "prompt_completion") -> Path:
    """`n` short records: prompt/completion (reverse a word list) or plain text."""
    rng = random.Random(seed)
    words = ["cat", "dog", "sun", "red", "blue", "tree", "moon", "fish", "bird", "star"]
    lines = []
    for _ in range(n):
        ws = rng.sample(words, rng.randint(2, 5))
        if kind == "text":
            lines.append({"text": " ".join(ws) + "."})
        else:
            lines.append({"prompt": "reverse: " + " ".join(ws) + "\n", "completion": " ".join(reversed(ws))})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def logged_lines(name: str):
    """The messages logger `name` logs at INFO or above inside the block, as a list filled while it runs."""
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger, handler = logging.getLogger(name), Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def host_devices_env(devices: int) -> dict:
    """The environment of a subprocess whose JAX sees `devices` CPU devices (XLA fixes the count at start-up)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")  # conftest's flags kept


def run_cli_on_host_devices(values: dict, yaml_path: Path, devices: int, timeout: int = 300,
                            dump_hlo: Path | None = None) -> tuple[list[dict], str]:
    """Write `values` as a run config to `yaml_path`, run `jaxft-train` on it in a subprocess on `devices` host
    devices (it must succeed); returns the metrics rows that carry a loss and the run's stdout + stderr.
    `dump_hlo`: XLA writes every compiled program's HLO text there (`--xla_dump_to`)."""
    import yaml

    from jaxft.train import read_metrics

    yaml_path.write_text(yaml.safe_dump(values))
    env = host_devices_env(devices)
    if dump_hlo is not None:
        env["XLA_FLAGS"] += f" --xla_dump_to={dump_hlo} --xla_dump_hlo_as_text"
        env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a program read from the run's cache (conftest) is not dumped
    res = subprocess.run([sys.executable, "-m", "jaxft.cli", str(yaml_path)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [r for r in read_metrics(Path(values["output_dir"]) / "metrics.jsonl") if "loss" in r]
    return rows, res.stdout + res.stderr


def tiny_run_config(tmp_path: Path, name: str, *, layers: int = 3, **values):
    """The `TrainConfig` of 3 steps of jaxft-train on a tiny Llama of `layers` layers (made once per `tmp_path`) and
    16 prompt/completion records, fp32, under `tmp_path / name`, with `values` (the execution keys under test) over
    the defaults."""
    from jaxft.train import TrainConfig

    model, data = tmp_path / f"tiny-{layers}", tmp_path / "tiny.jsonl"
    if not model.exists():
        make_tiny_model(model, layers=layers)
    if not data.exists():
        make_jsonl(data, 16)
    config = dict(model_name_or_path=str(model), dataset=str(data), output_dir=str(tmp_path / name), bf16=False,
                  max_seq_length=64, per_device_train_batch_size=2, max_steps=3, logging_steps=1, report_to="none",
                  disable_tqdm=True, lora_r=4, lora_alpha=8, seed=0)
    return TrainConfig(**{**config, **values})
