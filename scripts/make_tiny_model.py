#!/usr/bin/env python
"""Build ``examples/tiny-llama``: a byte-level BPE tokenizer and a ~1M-parameter
Llama model, briefly pre-trained on CPU so the quickstart LoRA has something to
adapt.

Steps (all deterministic given ``--seed``; run ``scripts/make_example_data.py``
first):

1. Train a byte-level BPE tokenizer (``tokenizers``) with ``--vocab-size``
   entries (special tokens included) on the text of ``train.jsonl``.  Digits are
   split one per token so arithmetic is learnable.  It is wrapped in
   ``transformers.PreTrainedTokenizerFast`` with a Llama-3-style chat template::

       <|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\n{content}<|eot_id|>
       <|start_header_id|>assistant<|end_header_id|>\\n\\n{content}<|eot_id|>

   Like Llama 3, plain ``tokenizer(text)`` prepends ``<|begin_of_text|>``; the
   chat template writes it itself, so tokenize rendered chats with
   ``add_special_tokens=False`` (``apply_chat_template(tokenize=True)`` does).
   Assistant turns are wrapped in ``{% generation %}`` so
   ``apply_chat_template(..., return_assistant_tokens_mask=True)`` works.
2. Build a ``LlamaConfig`` (hidden 128, intermediate 384, 4 layers, 4 heads,
   2 KV heads, head_dim 32, untied embeddings) and pre-train all parameters
   with next-token cross-entropy on every token of freshly generated chats of
   the *pre-training families only* (``PRETRAIN_FAMILIES`` in
   ``make_example_data.py``: half of the task families; one new chat per sample,
   none sharing a prompt with train.jsonl or eval.jsonl).  The model thus knows
   the chat format and has partly learnt half the tasks, and has never seen the
   other half, so a LoRA on the full ``train.jsonl`` visibly lowers the eval loss.
3. Save the model in float32 safetensors with its ``generation_config`` and
   print the eval loss (all tokens and assistant tokens only, per family
   group) of the saved model on ``eval.jsonl``.

Runtime: about 2.5 minutes of one CPU core (default 1000 steps of 32 chats,
~0.15 s a step; longer on a busy machine); torch uses one thread only.
``--check-lora`` additionally runs the quickstart recipe (LoRA r=16 on all
linear layers, lr 2e-3 cosine, 150 steps of 8 chats, loss on assistant tokens)
with ``peft`` as a reference and prints eval loss before/after (~15 s more).
Re-running with the same arguments rewrites byte-identical files.

Usage (from the repo root)::

    python scripts/make_example_data.py
    python scripts/make_tiny_model.py [--check-lora]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

# Single-threaded and reproducible: set before torch / tokenizers start pools.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

# Run as a script, so its folder (scripts/) is first on the module path: the data maker beside it imports as is.
from make_example_data import HELD_OUT_FAMILIES, PRETRAIN_FAMILIES, make_chat_records  # noqa: E402

PAD, BOS, EOT_TEXT, EOT, START_HEADER, END_HEADER = (
    "<|pad|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
)
# Order fixes the ids: pad=0, bos=1, end_of_text=2, eot=3, start_header=4, end_header=5.
SPECIAL_TOKENS = [PAD, BOS, EOT_TEXT, EOT, START_HEADER, END_HEADER]

PRETOKENIZE_PATTERN = r" ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|[\r\n]+|\s+(?!\S)|\s+"

# Llama-3-style headers. System may only come first; roles alternate user/assistant.
# `trim` matches Llama 3 (content whitespace at the ends is not part of the turn).
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unsupported role ' + message['role'] + '; use system, user or assistant') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'system' and not loop.first %}"
    "{{- raise_exception('a system message must be the first message') }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}"
    "{%- else %}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(records: list[dict], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE over the message texts (roles included; special tokens are added, not learned)."""
    tok = Tokenizer(models.BPE())
    # One split regex, then bytes -> printable chars.  Pieces: a word with its leading
    # space; a single digit (numbers are digit sequences, so copying and arithmetic
    # see the same tokens in prompt and answer); a run of newlines (so the "\n\n"
    # after a header is one token whether text or a generation prompt follows);
    # whitespace; punctuation with an optional leading space.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        for record in records:
            for message in record["messages"]:
                yield message["role"] + "\n\n" + message["content"]

    tok.train_from_iterator(texts(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama 3: plain encodes get a leading BOS; byte-level offsets kept untrimmed.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOT,  # the end of an assistant turn; generation stops here
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


# ----------------------------------------------------------------------------- data


def encode_chat(tokenizer: PreTrainedTokenizerFast, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the rendered chat and a 0/1 mask of the assistant tokens (content + <|eot_id|>)."""
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def make_batch(examples: list[tuple[list[int], list[int]]], pad_id: int, assistant_only: bool) -> dict:
    """Right-padded batch; labels are -100 on padding (and on non-assistant tokens if ``assistant_only``)."""
    length = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)
    for row, (ids, mask) in enumerate(examples):
        n = len(ids)
        input_ids[row, :n] = torch.tensor(ids)
        attention_mask[row, :n] = 1
        row_labels = torch.tensor(ids)
        if assistant_only:
            row_labels[torch.tensor(mask) == 0] = -100
        labels[row, :n] = row_labels
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def token_loss_sum(model, batch: dict) -> tuple[float, int]:
    """Sum of next-token cross-entropy over counted targets, and their number."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )
    return float(loss), int((targets != -100).sum())


@torch.no_grad()
def evaluate(model, tokenizer, records: list[dict], batch_size: int = 25) -> dict[str, float]:
    """Mean per-token eval loss: all tokens / assistant tokens, over all, seen and held-out families."""
    model.eval()
    encoded = [(encode_chat(tokenizer, r["messages"]), r["family"]) for r in records]
    groups = {"all": None, "pretrain_families": PRETRAIN_FAMILIES, "held_out_families": HELD_OUT_FAMILIES}
    result: dict[str, float] = {}
    for group, families in groups.items():
        chosen = [ex for ex, fam in encoded if families is None or fam in families]
        for assistant_only in (False, True):
            total, count = 0.0, 0
            for i in range(0, len(chosen), batch_size):
                batch = make_batch(chosen[i : i + batch_size], tokenizer.pad_token_id, assistant_only)
                s, n = token_loss_sum(model, batch)
                total, count = total + s, count + n
            result[f"{group}/{'assistant' if assistant_only else 'all_tokens'}"] = total / count
    return result


@torch.no_grad()
def exact_match(model, tokenizer, records: list[dict], max_new_tokens: int = 32) -> dict[str, float]:
    """Greedy-decoding exact-match accuracy per family (one prompt at a time: no padding subtleties)."""
    model.eval()
    hits: dict[str, list[int]] = {}
    for record in records:
        prompt = [m for m in record["messages"] if m["role"] != "assistant"]
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()
        hits.setdefault(record["family"], []).append(int(text == record["messages"][-1]["content"]))
    return {family: sum(v) / len(v) for family, v in sorted(hits.items())}


# ----------------------------------------------------------------------------- training


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float = 0.1) -> float:
    """Linear warmup to ``peak`` then cosine decay to ``final_frac * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_loop(model, params, examples, *, steps, batch_size, lr, warmup, weight_decay, pad_id, assistant_only, seed, log_every):
    """AdamW with clipped gradients on random batches (reshuffled each epoch)."""
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    rng = random.Random(seed)
    order: list[int] = []
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        if len(order) < batch_size:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order += fresh
        idx, order = order[:batch_size], order[batch_size:]
        batch = make_batch([examples[i] for i in idx], pad_id, assistant_only)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        loss = model(**batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        if step % log_every == 0 or step == steps - 1:
            print(f"  step {step:4d}  loss {loss.item():.4f}  lr {optimizer.param_groups[0]['lr']:.2e}"
                  f"  {time.perf_counter() - start:6.1f}s", flush=True)
    model.eval()


def check_lora(model_dir: Path, tokenizer, train_records, eval_records, seed: int) -> None:
    """Reference run of the quickstart recipe with peft: LoRA r=16/alpha 32 on all linear layers."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, trust_remote_code=False)
    model = get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    )
    params = [p for p in model.parameters() if p.requires_grad]
    print(f"LoRA check: {sum(p.numel() for p in params):,} trainable parameters")
    examples = [encode_chat(tokenizer, r["messages"]) for r in train_records]
    before = evaluate(model, tokenizer, eval_records)
    train_loop(model, params, examples, steps=150, batch_size=8, lr=2e-3, warmup=10, weight_decay=0.0,
               pad_id=tokenizer.pad_token_id, assistant_only=True, seed=seed, log_every=25)
    after = evaluate(model, tokenizer, eval_records)
    for key in before:
        print(f"  eval {key:34s} {before[key]:.4f} -> {after[key]:.4f}")
    for family, acc in exact_match(model, tokenizer, eval_records).items():
        print(f"  exact match after LoRA  {family:16s} {acc:.2f}")


def write_model_card(args, config: LlamaConfig, metrics: dict[str, float], accuracy: dict[str, float]) -> None:
    """A short README.md next to the weights: what the model is and how it scores on eval.jsonl."""
    lines = [
        "# tiny-llama (synthetic, for the jaxft quickstart and tests)",
        "",
        "Generated by `scripts/make_tiny_model.py"
        f" --seed {args.seed} --steps {args.steps} --batch-size {args.batch_size} --lr {args.lr}`; do not edit by hand.",
        "",
        f"Llama architecture: hidden {config.hidden_size}, intermediate {config.intermediate_size},"
        f" {config.num_hidden_layers} layers, {config.num_attention_heads} heads / {config.num_key_value_heads} KV heads,"
        f" head_dim {config.head_dim}, vocab {config.vocab_size}, untied embeddings, float32.",
        f"Pre-trained (all parameters, next-token loss on all tokens) on {args.steps * args.batch_size} fresh chats of"
        f" the families {', '.join(PRETRAIN_FAMILIES)}. Never saw: {', '.join(HELD_OUT_FAMILIES)}.",
        "",
        "Mean next-token loss (nats/token) on `examples/data/eval.jsonl`:",
        "",
        "| records | all tokens | assistant tokens |",
        "|---|---|---|",
    ]
    for group in ("all", "pretrain_families", "held_out_families"):
        lines.append(f"| {group} | {metrics[group + '/all_tokens']:.3f} | {metrics[group + '/assistant']:.3f} |")
    lines += ["", "Greedy exact-match accuracy per family:", "", "| family | accuracy |", "|---|---|"]
    lines += [f"| {family} | {acc:.2f} |" for family, acc in accuracy.items()]
    (args.out_dir / "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=Path("examples/data"))
    parser.add_argument("--out-dir", type=Path, default=Path("examples/tiny-llama"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--check-lora", action="store_true", help="also run the quickstart recipe with peft")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    t0 = time.perf_counter()

    train_records = read_jsonl(args.data_dir / "train.jsonl")
    eval_records = read_jsonl(args.data_dir / "eval.jsonl")

    tokenizer = train_tokenizer(train_records, args.vocab_size)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.out_dir)
    tokenizer = AutoTokenizer.from_pretrained(args.out_dir, trust_remote_code=False)  # train on exactly what is shipped
    print(f"tokenizer: {len(tokenizer)} tokens ({time.perf_counter() - t0:.1f}s)")

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).float()
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters")

    # Fresh chats of the pre-training families, one per sample (no repeats, so the
    # model learns the tasks instead of memorising prompts), none sharing a prompt
    # with train.jsonl or eval.jsonl: every shipped record is new to the model.
    seen = {r["messages"][-2]["content"] for r in train_records + eval_records}
    per_family = math.ceil(args.steps * args.batch_size / len(PRETRAIN_FAMILIES))
    chats = make_chat_records(random.Random(f"{args.seed}/pretrain"), per_family, seen, PRETRAIN_FAMILIES)
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in chats]
    pretrain = [(ids, [1] * len(ids)) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    print(f"pre-training on {len(pretrain)} fresh chats of families {', '.join(PRETRAIN_FAMILIES)}"
          f" ({sum(len(ids) for ids, _ in pretrain):,} tokens, {time.perf_counter() - t0:.0f}s)")
    t1 = time.perf_counter()
    train_loop(model, list(model.parameters()), pretrain, steps=args.steps, batch_size=args.batch_size,
               lr=args.lr, warmup=50, weight_decay=0.01, pad_id=tokenizer.pad_token_id,
               assistant_only=False, seed=args.seed, log_every=50)
    print(f"pre-training took {time.perf_counter() - t1:.0f}s")

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(EOT), tokenizer.convert_tokens_to_ids(EOT_TEXT)],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=64,
    )
    model.save_pretrained(args.out_dir)

    shipped = AutoModelForCausalLM.from_pretrained(args.out_dir, dtype=torch.float32,
                                                   trust_remote_code=False)
    metrics = evaluate(shipped, tokenizer, eval_records)
    accuracy = exact_match(shipped, tokenizer, eval_records)
    for key, value in metrics.items():
        print(f"eval loss {key:34s} {value:.4f}")
    for family, acc in accuracy.items():
        print(f"exact match (greedy)  {family:16s} {acc:.2f}")
    write_model_card(args, config, metrics, accuracy)
    print(f"total {time.perf_counter() - t0:.0f}s")

    if args.check_lora:
        check_lora(args.out_dir, tokenizer, train_records, eval_records, args.seed)


if __name__ == "__main__":
    main()
