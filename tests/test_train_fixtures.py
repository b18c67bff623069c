"""Shared builders for the training tests: a tiny Llama + char-level tokenizer saved as an HF directory, and
tiny JSONL data. (No tests here; `test_train*.py`, `test_cli*.py` and `test_resume*.py` import these.)"""

from __future__ import annotations

import json
import random
import string
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
