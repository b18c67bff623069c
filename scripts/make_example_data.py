#!/usr/bin/env python
"""Generate the synthetic instruction data shipped in ``examples/data/``.

Every record is an instruction whose answer is a deterministic function of the
prompt, drawn from eight small task families.  The families are split in two
groups on purpose:

* ``PRETRAIN_FAMILIES`` (uppercase, reverse_words, add, count_words): the tiny
  base model in ``examples/tiny-llama`` is pre-trained on these
  (``scripts/make_tiny_model.py``), so it knows the chat format and these tasks.
* ``HELD_OUT_FAMILIES`` (sort_numbers, repeat_word, largest_number,
  join_dashes): the base model has never seen them, so a LoRA fine-tune on
  ``train.jsonl`` visibly lowers the eval loss on them.

Outputs (all deterministic given ``--seed``):

* ``train.jsonl``  (3000 chat records, families balanced, shuffled)
* ``eval.jsonl``   (200 chat records, 25 per family, no prompt shared with train)
* ``completions.jsonl`` (300 prompt/completion records, for docs and tests)

A chat record is ``{"messages": [{"role": "system", ...} (30 % of records),
{"role": "user", "content": ...}, {"role": "assistant", "content": ...}],
"family": <name>}``.  The extra ``family`` key lets evaluations break the loss
down per task; loaders that only read ``messages`` ignore it.

Usage (from the repo root; takes about a second)::

    python scripts/make_example_data.py            # writes examples/data/
    python scripts/make_example_data.py --out-dir /tmp/data --seed 1
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

# A fixed word list (no external corpus) of short, common English words.
WORDS: tuple[str, ...] = tuple(
    """
    apple river stone cloud green light house paper water music bread table
    window garden silver orange yellow purple summer winter spring autumn
    forest ocean desert island valley mountain bridge castle tower market
    school doctor farmer driver singer dancer pilot sailor artist writer
    red blue black white small large quick slow happy quiet loud bright dark
    warm cold soft hard sweet sour fresh old new young tall short long round
    cat dog bird fish horse mouse lion tiger bear wolf fox frog duck goat
    sheep cow owl bee ant snake whale shark eagle rabbit turtle monkey zebra
    run jump swim walk read write sing dance cook clean build paint drive
    fly climb sleep dream laugh smile think learn teach play open close
    red moon star sun rain snow wind fire ice sand rock tree leaf flower
    grass seed root road path door key lock box cup plate spoon fork knife
    chair bed lamp clock phone book pen map ship train car bike boat plane
    """.split()
)
# Deduplicate while keeping the order stable (the list above repeats "red").
WORDS = tuple(dict.fromkeys(WORDS))

SYSTEM_PROMPTS: tuple[str, ...] = (
    "You are a helpful assistant.",
    "You are a precise assistant. Answer with the result only.",
    "Answer briefly and exactly.",
)
SYSTEM_PROB = 0.3

PRETRAIN_FAMILIES: tuple[str, ...] = ("uppercase", "reverse_words", "add", "count_words")
HELD_OUT_FAMILIES: tuple[str, ...] = ("sort_numbers", "repeat_word", "largest_number", "join_dashes")
FAMILIES: tuple[str, ...] = PRETRAIN_FAMILIES + HELD_OUT_FAMILIES


def _phrase(rng: random.Random, lo: int, hi: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]


def _numbers(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randint(0, 99) for _ in range(rng.randint(lo, hi))]


def _uppercase(rng: random.Random) -> tuple[str, str]:
    words = " ".join(_phrase(rng, 2, 6))
    template = rng.choice(
        ("Convert to uppercase: {s}", "Write this in capital letters: {s}", "Uppercase this text: {s}")
    )
    return template.format(s=words), words.upper()


def _reverse_words(rng: random.Random) -> tuple[str, str]:
    words = _phrase(rng, 2, 6)
    template = rng.choice(
        ("Reverse the words: {s}", "Reverse the order of these words: {s}", "Write these words in reverse order: {s}")
    )
    return template.format(s=" ".join(words)), " ".join(reversed(words))


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    template = rng.choice(("What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} + {b}."))
    return template.format(a=a, b=b), str(a + b)


def _count_words(rng: random.Random) -> tuple[str, str]:
    words = _phrase(rng, 1, 9)
    template = rng.choice(("How many words are in: {s}", "Count the words: {s}"))
    return template.format(s=" ".join(words)), str(len(words))


def _sort_numbers(rng: random.Random) -> tuple[str, str]:
    xs = _numbers(rng, 3, 6)
    template = rng.choice(
        ("Sort these numbers: {xs}", "Sort in ascending order: {xs}", "Put these numbers in order: {xs}")
    )
    return template.format(xs=", ".join(map(str, xs))), ", ".join(map(str, sorted(xs)))


def _repeat_word(rng: random.Random) -> tuple[str, str]:
    word, n = rng.choice(WORDS), rng.randint(2, 5)
    template = rng.choice(("Repeat '{w}' {n} times.", "Say '{w}' {n} times."))
    return template.format(w=word, n=n), " ".join([word] * n)


def _largest_number(rng: random.Random) -> tuple[str, str]:
    xs = _numbers(rng, 3, 6)
    template = rng.choice(("Which number is largest: {xs}?", "Find the maximum of: {xs}"))
    return template.format(xs=", ".join(map(str, xs))), str(max(xs))


def _join_dashes(rng: random.Random) -> tuple[str, str]:
    words = _phrase(rng, 2, 6)
    template = rng.choice(("Join these words with dashes: {s}", "Connect the words with hyphens: {s}"))
    return template.format(s=" ".join(words)), "-".join(words)


GENERATORS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "uppercase": _uppercase,
    "reverse_words": _reverse_words,
    "add": _add,
    "count_words": _count_words,
    "sort_numbers": _sort_numbers,
    "repeat_word": _repeat_word,
    "largest_number": _largest_number,
    "join_dashes": _join_dashes,
}
assert tuple(GENERATORS) == FAMILIES


def make_chat_records(
    rng: random.Random, per_family: int, exclude: set[str], families: tuple[str, ...] = FAMILIES
) -> list[dict]:
    """``per_family`` records of each of ``families`` whose user prompt is not in ``exclude``.

    Prompts are unique within the returned list too (added to ``exclude``), so
    train and eval never share a prompt when the same set is passed to both.
    """
    records: list[dict] = []
    for family in families:
        made = 0
        while made < per_family:
            prompt, answer = GENERATORS[family](rng)
            if prompt in exclude:
                continue
            exclude.add(prompt)
            messages = []
            if rng.random() < SYSTEM_PROB:
                messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            messages.append({"role": "user", "content": prompt})
            messages.append({"role": "assistant", "content": answer})
            records.append({"messages": messages, "family": family})
            made += 1
    rng.shuffle(records)
    return records


def make_completion_records(rng: random.Random, n: int, exclude: set[str]) -> list[dict]:
    """Prompt/completion pairs: ``prompt`` ends with ``"\\nAnswer:"``, ``completion`` starts with a space."""
    records: list[dict] = []
    while len(records) < n:
        family = FAMILIES[len(records) % len(FAMILIES)]
        prompt, answer = GENERATORS[family](rng)
        if prompt in exclude:
            continue
        exclude.add(prompt)
        records.append({"prompt": f"{prompt}\nAnswer:", "completion": f" {answer}", "family": family})
    rng.shuffle(records)
    return records


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("examples/data"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-per-family", type=int, default=375, help="8 families x 375 = 3000 records")
    parser.add_argument("--eval-per-family", type=int, default=25, help="8 families x 25 = 200 records")
    parser.add_argument("--completions", type=int, default=300)
    args = parser.parse_args(argv)

    # One generator per split, each seeded from --seed, so changing the size of
    # one split does not change the contents of the others.  Eval is drawn
    # first so it stays fixed when the train size changes.
    seen: set[str] = set()
    eval_records = make_chat_records(random.Random(f"{args.seed}/eval"), args.eval_per_family, seen)
    train_records = make_chat_records(random.Random(f"{args.seed}/train"), args.train_per_family, seen)
    completion_records = make_completion_records(
        random.Random(f"{args.seed}/completions"), args.completions, seen
    )

    write_jsonl(args.out_dir / "train.jsonl", train_records)
    write_jsonl(args.out_dir / "eval.jsonl", eval_records)
    write_jsonl(args.out_dir / "completions.jsonl", completion_records)
    for name, records in (("train", train_records), ("eval", eval_records), ("completions", completion_records)):
        print(f"wrote {len(records):5d} records to {args.out_dir / (name + '.jsonl')}")


if __name__ == "__main__":
    main()
