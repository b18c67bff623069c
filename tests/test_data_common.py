"""Shared helpers for the data tests (no tests here): tiny tokenizers and file writers."""

from __future__ import annotations

import hashlib
import json
import string
from pathlib import Path

import pyarrow as pa
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Same layout, replies marked for `return_assistant_tokens_mask`.
CHATML_GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Rewrites history like reasoning templates do: only the last reply keeps its <think> block,
# so rendering a prefix of the chat is not a prefix of the full rendering.
CHATML_THINK = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama-2 style: no end-of-turn newline, the reply is followed by the EOS text.
INST = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
    "{% elif m.role == 'assistant' %} {{ m.content }} {{ eos_token }}{% endif %}{% endfor %}"
)

CORPUS = [
    "hello world how are you today",
    "the quick brown fox jumps over the lazy dog",
    "what is two plus two ? it is four .",
    "system user assistant think answer question",
    "a long document about packing rows of tokens into batches",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]


def make_tokenizer(
    root: Path,
    *,
    chat_template: str | None = CHATML,
    style: str = "bytelevel",
    add_bos: bool = True,
    eos: str = "<|im_end|>",
):
    """Train a tiny BPE tokenizer, save it as a model directory, and load it back with
    `AutoTokenizer` (the path training uses). ``style``: "bytelevel" (GPT-2 like) or
    "metaspace" (SentencePiece like: a reply token carries its leading space)."""
    tok = Tokenizer(models.BPE(unk_token=None if style == "bytelevel" else "<|endoftext|>"))
    if style == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
        alphabet = sorted(set("".join(CORPUS)) | set(string.ascii_letters + string.digits + "[]/▁?.!,\n"))
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=alphabet)
    tok.train_from_iterator(CORPUS, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token=eos, pad_token="<|endoftext|>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    key = hashlib.sha1(repr((chat_template, style, add_bos, eos)).encode()).hexdigest()[:10]
    model_dir = root / f"tok_{key}"
    fast.save_pretrained(model_dir)
    return AutoTokenizer.from_pretrained(model_dir), model_dir


def write_jsonl(path: Path, rows, *, raw_lines: dict[int, str] | None = None) -> Path:
    """Write rows as JSON Lines; ``raw_lines`` replaces given 1-based lines verbatim."""
    lines = [json.dumps(r) for r in rows]
    for lineno, text in (raw_lines or {}).items():
        lines[lineno - 1] = text
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_arrow_stream(path: Path, rows, *, chunk: int | None = None) -> Path:
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=chunk)
    return path


def write_saved_dataset(d: Path, shards: list[list[dict]]) -> Path:
    """A directory laid out like ``datasets.Dataset.save_to_disk`` (Arrow IPC stream shards)."""
    d.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{len(shards):05d}.arrow" for i in range(len(shards))]
    for name, rows in zip(names, shards):
        write_arrow_stream(d / name, rows, chunk=2)
    (d / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": n} for n in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": None,
    }))
    (d / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": {}}))
    return d


def chat(user: str, reply: str, *more: str) -> dict:
    """A chat record: user/assistant turns alternating (``more`` continues the alternation)."""
    turns = [user, reply, *more]
    roles = ["user", "assistant"]
    return {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}
