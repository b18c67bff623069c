#!/usr/bin/env python
"""Generate the preference pairs shipped in ``examples/data/`` for the DPO example (``examples/dpo.yaml``).

Each pair takes a chat of ``train.jsonl`` / ``eval.jsonl`` (``scripts/make_example_data.py``): the prompt is its
messages before the reply (a system message, where there is one, and the user's), ``chosen`` its correct reply, and
``rejected`` the reply of another chat of the same task family: an answer of the right form that is wrong for this
prompt, so the preference is learnable from the prompt alone. Records are TRL's conversational preference format::

    {"prompt": [{"role": "user", "content": "What is 17 + 25?"}],
     "chosen": [{"role": "assistant", "content": "42"}],
     "rejected": [{"role": "assistant", "content": "31"}], "family": "add"}

Outputs (deterministic given ``--seed``): ``preference.jsonl`` (400 pairs from train.jsonl, 50 per family) and
``preference_eval.jsonl`` (80 pairs from eval.jsonl, 10 per family).

Usage (from the repo root; well under a second)::

    python scripts/make_preference_data.py
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict
from pathlib import Path


def pairs(chats: list[dict], per_family: int, rng: random.Random) -> list[dict]:
    """`per_family` pairs of each family: a chat's reply chosen, another chat's (a different answer) rejected."""
    by_family = defaultdict(list)
    for chat in chats:
        by_family[chat["family"]].append(chat)
    out = []
    for family in sorted(by_family):
        group = by_family[family]
        for chat in rng.sample(group, per_family):
            reply = chat["messages"][-1]["content"]
            others = [c["messages"][-1]["content"] for c in group if c["messages"][-1]["content"] != reply]
            out.append({"prompt": chat["messages"][:-1], "chosen": [chat["messages"][-1]],
                        "rejected": [{"role": "assistant", "content": rng.choice(others)}], "family": family})
    rng.shuffle(out)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path("examples/data"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    for source, target, per_family in (("train.jsonl", "preference.jsonl", 50),
                                       ("eval.jsonl", "preference_eval.jsonl", 10)):
        chats = [json.loads(line) for line in (args.data_dir / source).read_text(encoding="utf-8").splitlines()]
        records = pairs(chats, per_family, rng)
        (args.data_dir / target).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        print(f"wrote {len(records)} pairs to {args.data_dir / target}")


if __name__ == "__main__":
    main()
