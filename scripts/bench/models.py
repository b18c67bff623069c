"""Random-weight model directories for the benchmark (torch + transformers; no downloads).

``save_random_model`` builds the HF model of a shape with random weights directly on the target
device (initialising an 8B model on the GPU takes seconds, on CPU minutes), casts nothing (it is
created in bf16) and writes it with ``save_pretrained`` (safetensors) next to a small generated
tokenizer. Every system then loads that same directory, so all of them start from identical
weights. The tokenizer only exists because Unsloth's loader insists on one: its vocabulary (256
word-level tokens) is far smaller than the model's and the benchmark never tokenises text. A
vision-language shape's directory also gets its image processor's preprocessor_config.json (the
real model's) and the tokenizer its vision special tokens at the config's ids (<|image_pad|> ->
image_token_id, ...), so a processor built from the directory agrees with the config.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from .workloads import ModelShape

TOKENIZER_VOCAB = 256
SPECIAL_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


# Qwen2-VL / Qwen2.5-VL vision special tokens and the config key holding each one's id.
VISION_TOKENS = {"<|vision_start|>": "vision_start_token_id", "<|vision_end|>": "vision_end_token_id",
                 "<|image_pad|>": "image_token_id", "<|video_pad|>": "video_token_id"}


def save_tokenizer(save_dir: str, shape: ModelShape | None = None) -> None:
    """A word-level fast tokenizer with ids 0..3 = <unk>, <s>, </s>, <pad> (config ids match), plus a
    vision-language shape's vision tokens at its config's ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS.values())}
    vocab.update({f"t{i}": i for i in range(len(vocab), TOKENIZER_VOCAB)})
    extra = {}
    if shape is not None and shape.is_vlm:
        extra = {tok: int(shape.get(key)) for tok, key in VISION_TOKENS.items()}
        clash = sorted(t for t, i in extra.items() if i < TOKENIZER_VOCAB)
        if clash:
            raise ValueError(f"ModelShape {shape.name!r}: vision token ids of {clash} must be >= {TOKENIZER_VOCAB} "
                             "(the word-level tokenizer's own ids)")
        vocab.update(extra)
    backend = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)
    if extra:
        fast.add_special_tokens({"additional_special_tokens": list(extra)})
    fast.save_pretrained(save_dir)


def save_processor_config(shape: ModelShape, save_dir: str) -> None:
    """The real model's preprocessor_config.json (what AutoImageProcessor and AutoProcessor read)."""
    with open(os.path.join(save_dir, "preprocessor_config.json"), "w") as f:
        json.dump(dict(shape.processor_config), f, indent=2)


def build_config(shape: ModelShape):
    from transformers import AutoConfig

    cfg = shape.config_dict()
    model_type = cfg.pop("model_type")
    return AutoConfig.for_model(model_type, **cfg)


def random_model(shape: ModelShape, device: str, seed: int = 0, **kwargs):
    """The HF model of ``shape`` with random bf16 weights (transformers' own init, seeded), made on ``device``;
    ``kwargs`` go to ``from_config`` (e.g. attn_implementation)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    with torch.device(device):
        auto = AutoModelForImageTextToText if shape.is_vlm else AutoModelForCausalLM
        return auto.from_config(build_config(shape), dtype=torch.bfloat16, **kwargs)


def save_random_model(shape: ModelShape, save_dir: str, device: str, seed: int = 0) -> dict[str, Any]:
    """Create the model of ``shape`` with random bf16 weights on ``device`` and save it."""
    import torch

    marker = os.path.join(save_dir, "bench_saved.json")
    if os.path.exists(marker):  # a kept --workdir: the same shape and seed were saved by an earlier call
        with open(marker) as f:
            saved = json.load(f)
        if saved.get("shape") == shape.name and saved.get("seed") == seed:
            return {**saved, "reused": True}
    os.makedirs(save_dir, exist_ok=True)
    t0 = time.perf_counter()
    model = random_model(shape, device, seed)
    n_params = sum(p.numel() for p in model.parameters())
    t1 = time.perf_counter()
    model.save_pretrained(save_dir)
    save_tokenizer(save_dir, shape)
    if shape.is_vlm:
        save_processor_config(shape, save_dir)
    t2 = time.perf_counter()
    size = sum(os.path.getsize(os.path.join(save_dir, f)) for f in os.listdir(save_dir))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    result = {"model_dir": save_dir, "shape": shape.name, "seed": seed, "params": int(n_params),
              "bytes_on_disk": int(size), "init_s": t1 - t0, "save_s": t2 - t1}
    with open(marker, "w") as f:  # written last: a killed save leaves no marker
        json.dump(result, f)
    return result
