#!/usr/bin/env python
"""Build ``examples/tiny-qwen3-moe``: a tiny random Qwen3-MoE checkpoint for ``examples/moe.yaml``.

The model is a ``transformers.Qwen3MoeForCausalLM`` (2 decoder layers, 8 experts of which each token takes 2, with
the router's load-balancing loss on) whose vocabulary is the quickstart tokenizer's, copied from
``examples/tiny-llama`` with its chat template, so the quickstart's chats (``examples/data``) train it as they are.
Its weights are random (float32 safetensors, 1.4 MB): the example shows the MoE path (expert LoRA through
PEFT's ``target_parameters``, the router loss, the PEFT adapter out), not a model worth adapting.

Deterministic for a given ``--seed``: the same weights on a re-run, whatever the torch version (numpy draws them).
Usage, from the repo root: ``python scripts/make_moe_example.py``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

TOKENIZER = Path("examples/tiny-llama")
CONFIG = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.001,
              max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=3,
              pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def make_model_dir(out: Path, seed: int = 0) -> Path:
    import numpy as np
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG)).to(torch.float32)
    # The weights come from numpy's seeded generator, not torch's initialisers, so the bytes do not depend on the
    # torch version: norms 1, every other tensor normal with transformers' std (initializer_range 0.02).
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            value = np.ones(param.shape) if name.endswith("norm.weight") else rng.normal(0.0, 0.02, param.shape)
            param.copy_(torch.from_numpy(value.astype(np.float32)))
    model.generation_config.eos_token_id = [3, 2]  # <|eot_id|> ends a turn, as in the tiny Llama
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER / name, out / name)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("examples/tiny-qwen3-moe"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_model_dir(args.model_dir, args.seed)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    config = json.loads((out / "config.json").read_text())
    experts = config.get("num_local_experts", config.get("num_experts"))  # transformers' key moved
    print(f"wrote {config['model_type']} ({experts} experts) to {out} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
