#!/usr/bin/env python
"""Build the vision-language example: a synthetic image dataset and a tiny random Qwen2-VL model directory.

1. ``examples/data/vlm/``: PNG pictures (56-112 px) of 1-4 shapes (circle, square, triangle) of one colour
   (red, green, blue, yellow) on a light background, and chat records in ``train.jsonl`` / ``eval.jsonl``
   asking how many shapes there are, which colour or shape they are, or which of two pictures holds more
   shapes (two image parts in one user turn). Each record::

       {"messages": [{"role": "user", "content": [{"type": "image", "image": "images/0003.png"},
                                                   {"type": "text", "text": "How many shapes are there?"}]},
                     {"role": "assistant", "content": [{"type": "text", "text": "There are 3 shapes."}]}]}

   Image paths are relative to the JSONL file.
2. ``examples/tiny-qwen2-vl/``: a byte-level BPE tokenizer trained on the records' text with Qwen's special
   tokens (``<|im_start|>``, ``<|im_end|>``, ``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``) and a
   ChatML template that writes ``<|vision_start|><|image_pad|><|vision_end|>`` per image part; a
   ``Qwen2VLForConditionalGeneration`` with random weights (text: 2 layers of width 64; vision: 2 blocks of width
   32, patch 14, merge 2) saved by transformers; and ``preprocessor_config.json`` for transformers' Qwen2-VL
   image processor (56 x 56 to 112 x 112 pixels: 4 to 16 image tokens per picture).

Deterministic for a given ``--seed`` (the same bytes on a re-run). ``examples/vlm.yaml`` trains a LoRA on it.

Usage (from the repo root): ``python scripts/make_vlm_example.py [--records 200]``
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
SHAPES = ("circle", "square", "triangle")
WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14, "temporal_patch_size": 2,
             "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
             "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
             "processor_class": "Qwen2VLProcessor"}
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-6, max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
VISION = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
              temporal_patch_size=2, in_channels=3)


# ----------------------------------------------------------------------------- pictures and records

def draw(rng: random.Random, count: int, colour: str, shape: str):
    """A picture of `count` non-overlapping shapes of one colour and kind, 56-112 px a side."""
    from PIL import Image, ImageDraw

    w, h = rng.randrange(56, 113, 8), rng.randrange(56, 113, 8)
    image = Image.new("RGB", (w, h), (245, 245, 240))
    pen = ImageDraw.Draw(image)
    size = max(10, min(w, h) // 3)
    placed: list[tuple[int, int]] = []
    for _ in range(200):
        if len(placed) == count:
            break
        x, y = rng.randrange(0, w - size), rng.randrange(0, h - size)
        if all(abs(x - a) >= size or abs(y - b) >= size for a, b in placed):
            placed.append((x, y))
    for x, y in placed:
        box = (x, y, x + size - 1, y + size - 1)
        fill = COLOURS[colour]
        if shape == "circle":
            pen.ellipse(box, fill=fill)
        elif shape == "square":
            pen.rectangle(box, fill=fill)
        else:
            pen.polygon([(x + size // 2, y), (x, y + size - 1), (x + size - 1, y + size - 1)], fill=fill)
    return image, len(placed)


def _chat(images: list[str], question: str, answer: str) -> dict:
    parts = [{"type": "image", "image": p} for p in images] + [{"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": parts},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}


def make_dataset(out: Path, records: int = 200, eval_records: int = 24, seed: int = 0) -> list[dict]:
    """Writes images/*.png, train.jsonl and eval.jsonl under `out`; returns every record."""
    rng = random.Random(seed)
    (out / "images").mkdir(parents=True, exist_ok=True)
    counter = 0

    def picture(avoid: int = 0):
        """A new picture file (its shape count differs from `avoid`): (name, count, colour, shape)."""
        nonlocal counter
        while True:
            colour, shape = rng.choice(sorted(COLOURS)), rng.choice(SHAPES)
            image, n = draw(rng, rng.randint(1, 4), colour, shape)
            if n != avoid:
                break
        name = f"images/{counter:04d}.png"
        counter += 1
        image.save(out / name, optimize=True)
        return name, n, colour, shape

    rows = []
    for i in range(records + eval_records):
        kind = i % 4
        if kind == 3:  # two pictures
            a, na, _, _ = picture()
            b, nb, _, _ = picture(avoid=na)
            answer = f"The {'first' if na > nb else 'second'} picture has more shapes."
            rows.append(_chat([a, b], "Which picture has more shapes?", answer))
            continue
        name, n, colour, shape = picture()
        if kind == 0:
            rows.append(_chat([name], "How many shapes are there?", f"There {'is' if n == 1 else 'are'} "
                              f"{WORDS[n]} {shape if n == 1 else shape + 's'}."))
        elif kind == 1:
            rows.append(_chat([name], "What colour are the shapes?", f"They are {colour}."))
        else:
            rows.append(_chat([name], "What shape do you see?", f"I see {WORDS[n]} {colour} "
                              f"{shape if n == 1 else shape + 's'}."))
    for name, part in (("train.jsonl", rows[:records]), ("eval.jsonl", rows[records:])):
        with (out / name).open("w", encoding="utf-8") as f:
            for r in part:
                f.write(json.dumps(r) + "\n")
    return rows


# ----------------------------------------------------------------------------- tokenizer and model

def _texts(rows: list[dict]):
    for r in rows:
        for m in r["messages"]:
            yield m["role"] + "\n" + "".join(p.get("text", "") for p in m["content"])


def make_tokenizer(rows: list[dict], vocab_size: int = 320):
    """Byte-level BPE over the records' text, with Qwen's special tokens and the ChatML + image template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_texts(rows), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE, model_max_length=2048, padding_side="right",
                                   clean_up_tokenization_spaces=False)


def make_model_dir(out: Path, rows: list[dict], *, kind: str = "qwen2_vl", seed: int = 0) -> Path:
    """Tokenizer, random Qwen2-VL (or 2.5-VL) weights and the image processor's config under `out`."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(rows)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vision = dict(VISION)
    if kind == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=4, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    config = transformers.AutoConfig.for_model(
        kind, text_config={**TEXT, "vocab_size": len(tokenizer), "bos_token_id": None, "pad_token_id": ids["<|endoftext|>"],
                           "eos_token_id": ids["<|im_end|>"]}, vision_config=vision,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    torch.manual_seed(seed)
    cls = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}[kind]
    model = getattr(transformers, cls)._from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=2) + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path("examples/data/vlm"))
    parser.add_argument("--model-dir", type=Path, default=Path("examples/tiny-qwen2-vl"))
    parser.add_argument("--records", type=int, default=200)
    parser.add_argument("--eval-records", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = make_dataset(args.data_dir, args.records, args.eval_records, args.seed)
    make_model_dir(args.model_dir, rows, seed=args.seed)
    size = sum(f.stat().st_size for d in (args.data_dir, args.model_dir) for f in d.rglob("*") if f.is_file())
    print(f"wrote {len(rows)} records to {args.data_dir} and the model to {args.model_dir} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
