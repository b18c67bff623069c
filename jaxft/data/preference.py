"""Preference pairs for DPO: records -> (chosen, rejected) token documents -> rows that hold whole pairs.

Records are TRL's preference format: ``prompt``, ``chosen`` and ``rejected``, either three strings (standard)
or three lists of messages (conversational); a conversational record without ``prompt`` has it extracted as
the messages ``chosen`` and ``rejected`` share from the start (TRL's ``extract_prompt``). Each pair becomes two
documents, prompt+chosen and prompt+rejected, each tokenized exactly as SFT tokenizes a prompt/completion record
with that prompt (`jaxft.data.formatting.Formatter`, completion-only): the same chat template, and the same mask,
so only the completion (a chat's assistant reply with its end-of-turn marker; a string completion and EOS) counts
in the sequence's log-probability.

Packing: a pair is laid out whole in one row, chosen then rejected, so the row's documents 2k+1 and 2k+2
(`segment_ids`, 1-based) are the chosen and rejected sequences of its k-th pair, and one forward pass of a batch
scores both sides of every pair in it. Rows are filled best-fit decreasing by pair length (`best_fit_decreasing`);
batches are otherwise those of `PackedDataset` (same keys, same deterministic order per step). A pair longer than
a row is cut: each of its sequences keeps its first L tokens, L the largest that fits both in the row (TRL's
``keep_start`` truncation with max_length L); a pair left without a completion token on either side is skipped.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from jaxft.data.errors import DataConfigError, EmptyDatasetError, MissingFieldError
from jaxft.data.formatting import Document, Formatter, load_tokenizer
from jaxft.data.packing import PackedDataset, PackingStats, best_fit_decreasing
from jaxft.data.sources import Record, parse_records

logger = logging.getLogger("jaxft.data")

PREFERENCE_KEYS = ("prompt", "chosen", "rejected")


def preference_fields(record: Record) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a preference record, checked: three strings, or three lists of messages (the
    prompt extracted when absent); a `MissingFieldError` naming the record and the key otherwise."""
    d, src = record.data, record.source
    present = {k for k, v in d.items() if v is not None}
    for key in ("chosen", "rejected"):
        if key not in present:
            other = "rejected" if key == "chosen" else "chosen"
            has = f"has {other!r} but no {key!r}" if other in present else f"has keys {sorted(d)} but no {key!r}"
            raise MissingFieldError(f"{src}: preference record {has}; DPO trains on records with 'prompt', 'chosen' "
                                    f"and 'rejected' (strings, or lists of messages): add {key!r}")
    chosen, rejected = d["chosen"], d["rejected"]
    if "prompt" not in present:
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise MissingFieldError(f"{src}: preference record has no 'prompt'; add the prompt (the shared prompt is "
                                    "extracted only from conversational chosen/rejected lists of messages)")
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == 0:
            raise MissingFieldError(f"{src}: preference record has no 'prompt' and its 'chosen' and 'rejected' "
                                    "messages share no first message to take as the prompt; add 'prompt'")
        return chosen[:shared], chosen[shared:], rejected[shared:]
    prompt = d["prompt"]
    kinds = {key: isinstance(d[key], str) for key in PREFERENCE_KEYS if isinstance(d[key], (str, list))}
    for key in PREFERENCE_KEYS:
        if key not in kinds:
            raise MissingFieldError(f"{src}: key {key!r} must be a string or a list of messages, got "
                                    f"{type(d[key]).__name__}; fix the record")
    if len(set(kinds.values())) > 1:
        strings = ", ".join(repr(k) for k, s in kinds.items() if s)
        lists = ", ".join(repr(k) for k, s in kinds.items() if not s)
        raise MissingFieldError(f"{src}: {strings} given as text but {lists} as lists of messages; give all three as "
                                "strings (standard) or all three as lists of messages (conversational)")
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if isinstance(value, list) and not value:
            raise MissingFieldError(f"{src}: key {key!r} is an empty list; give the reply as messages, e.g. "
                                    "[{\"role\": \"assistant\", \"content\": ...}]")
    return prompt, chosen, rejected


def preference_pair(fmt: Formatter, record: Record) -> tuple[Document, Document]:
    """The (prompt+chosen, prompt+rejected) documents of a preference record, each tokenized as an SFT
    prompt/completion record (`fmt` must train on the completion only)."""
    if not fmt.completion_only_loss:
        raise DataConfigError("preference pairs score the completion only: build the Formatter with "
                              "completion_only_loss=True")
    prompt, chosen, rejected = preference_fields(record)
    return tuple(fmt(Record({"prompt": prompt, "completion": side}, record.source)) for side in (chosen, rejected))


def _kept_length(chosen: int, rejected: int, max_seq_length: int) -> int:
    """L: the tokens each sequence of a pair keeps, the largest L with min(chosen, L) + min(rejected, L) <=
    max_seq_length (no cut: the longer length)."""
    if chosen + rejected <= max_seq_length:
        return max(chosen, rejected)
    short = min(chosen, rejected)
    return max_seq_length - short if short <= max_seq_length // 2 else max_seq_length // 2


class PreferenceDataset(PackedDataset):
    """Preference pairs packed whole into rows of ``max_seq_length`` tokens (see the module docstring); batches are
    `PackedDataset` batches, whose pair k of a row is segments 2k+1 (chosen) and 2k+2 (rejected). Only the layout
    differs from the base class, so this sets the fields its batch methods read (documents, rows, stats) itself."""

    def __init__(self, pairs: Sequence[tuple[Document, Document]], *, max_seq_length: int, batch_size: int,
                 seed: int = 0, shuffle: bool = True, name: str = "train"):
        if not isinstance(max_seq_length, int) or max_seq_length < 4:
            raise DataConfigError(f"max_seq_length must be an int >= 4 (a pair of two sequences per row), got "
                                  f"{max_seq_length!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise DataConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.max_seq_length, self.batch_size, self.seed, self.shuffle, self.name = (
            max_seq_length, batch_size, int(seed), bool(shuffle), name)
        self.images = None
        tokens, masks, cut, skipped = [], [], [], []
        for chosen, rejected in pairs:
            keep = _kept_length(len(chosen), len(rejected), max_seq_length)
            sides = [(d.tokens[:keep], d.loss_mask[:keep]) for d in (chosen, rejected)]
            if not all(m[1:].any() for _, m in sides):
                skipped.append(chosen.source)
                continue
            if keep < max(len(chosen), len(rejected)):
                cut.append(chosen.source)
            for t, m in sides:
                tokens.append(t)
                masks.append(m)
        lengths = np.array([len(t) for t in tokens], dtype=np.int64)
        self._doc_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self._doc_len = lengths
        self._tokens = np.concatenate(tokens) if tokens else np.zeros(0, np.int32)
        self._mask = np.concatenate(masks) if masks else np.zeros(0, bool)
        bins = best_fit_decreasing(lengths[0::2] + lengths[1::2], max_seq_length) if tokens else []
        self._rows = [np.array([d for pair in b for d in (2 * pair, 2 * pair + 1)], dtype=np.int64) for b in bins]
        self._images = [()] * len(tokens)
        self.max_row_patches = self.max_row_images = 0
        self.num_pairs = len(tokens) // 2
        self.stats = PackingStats(
            max_seq_length=max_seq_length, num_input=2 * len(pairs), num_documents=len(tokens),
            num_rows=len(self._rows),
            real_tokens=int(lengths.sum()), trained_tokens=int(sum(m[1:].sum() for m in masks)),
            truncated=2 * len(cut), dropped=0, skipped=2 * len(skipped))
        self._epoch_cache = None
        notes = []
        if cut:
            notes.append(f"{len(cut)} pair{'s' if len(cut) > 1 else ''} longer than "
                         f"max_seq_length={max_seq_length} (one row holds a whole pair) "
                         f"{'were' if len(cut) > 1 else 'was'} truncated: "
                         f"{', '.join(cut[:3])}{' ...' if len(cut) > 3 else ''}; raise max_seq_length to keep "
                         "them whole")
        if skipped:
            notes.append(f"{len(skipped)} pair{'s' if len(skipped) > 1 else ''} with no completion token left "
                         f"within max_seq_length={max_seq_length} {'were' if len(skipped) > 1 else 'was'} skipped: "
                         f"{', '.join(skipped[:3])}{' ...' if len(skipped) > 3 else ''}; raise max_seq_length or "
                         "shorten the prompts")
        if not self._rows:
            raise EmptyDatasetError(f"{name} data: no trainable preference pair left of {len(pairs)}"
                                    + (f": {'; '.join(notes)}" if notes else ""))
        for note in notes:
            logger.warning("%s data: %s", name, note)
        logger.info("%s data: %d preference pairs in %d rows of %d tokens (efficiency %.1f%%, %d completion tokens)",
                    name, self.num_pairs, self.num_rows, max_seq_length, 100 * self.stats.efficiency,
                    self.stats.trained_tokens)


def build_preference_datasets(config, tokenizer) -> tuple[PreferenceDataset, PreferenceDataset | None]:
    """The train (shuffled per epoch) and eval (in order) preference datasets of a `jaxft.data.DataConfig`
    (``max_seq_length``: tokens per row, a row holding whole pairs; ``batch_size``: rows per step). ``tokenizer``
    is a Hugging Face tokenizer or a model directory. Raises a `DataError` naming the file/line/key on bad input."""
    if isinstance(tokenizer, (str, Path)):
        tokenizer = load_tokenizer(tokenizer)
    fmt = Formatter(tokenizer, completion_only_loss=True, text_field=config.text_field)
    train = parse_records(config.path, config.split, lambda r: preference_pair(fmt, r), "preference records")
    evals = None
    if config.eval_path or config.eval_split:
        evals = parse_records(config.eval_path or config.path, config.eval_split,
                              lambda r: preference_pair(fmt, r), "preference records")
    elif config.eval_fraction > 0:
        n_eval = max(1, round(len(train) * config.eval_fraction))
        if n_eval >= len(train):
            raise EmptyDatasetError(f"{config.path}: eval_fraction={config.eval_fraction} of {len(train)} pairs "
                                    "leaves no training data; lower eval_fraction or add data")
        held = set(np.random.default_rng([config.seed, 0x5EED]).permutation(len(train))[:n_eval].tolist())
        evals = [p for i, p in enumerate(train) if i in held]
        train = [p for i, p in enumerate(train) if i not in held]
    common = dict(max_seq_length=config.max_seq_length, seed=config.seed)
    train_ds = PreferenceDataset(train, batch_size=config.batch_size, shuffle=True, name="train", **common)
    eval_ds = None
    if evals is not None:
        eval_ds = PreferenceDataset(evals, batch_size=config.eval_batch_size or config.batch_size, shuffle=False,
                                    name="eval", **common)
    return train_ds, eval_ds
