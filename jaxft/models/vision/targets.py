"""LoRA placement for vision-language models as Unsloth's `FastVisionModel.get_peft_model` spells it.

`finetune_targets(model_type, finetune_vision_layers=..., finetune_language_layers=...,
finetune_attention_modules=..., finetune_mlp_modules=...)` is a `LoraConfig.target_modules` regex (PEFT's rule:
`re.fullmatch` on transformers' module names) selecting the linears of the chosen halves (vision blocks,
language layers) and kinds (attention: q/k/v/o, the tower's qkv/proj; MLP: gate/up/down, the tower's fc1/fc2).
The names come from the family's module table, so an adapter trained with it names the same modules in PEFT.
The merger and the LM head are never selected, as in Unsloth (unsloth_zoo/peft_utils.py `get_peft_regex`: a linear
leaf name seen once in the model and not inside a numbered layer stack is set aside as a projection, which is
what `visual.merger.mlp.0` / `.mlp.2` are); name them in `target_modules` to adapt them (`jaxft.lora`).
"""

from __future__ import annotations

import re

from jaxft.errors import ConfigError
from jaxft.families import family_for


def _kind(path: tuple[str, ...]) -> tuple[str, str] | None:
    """(half, kind) of a kernel path: ("language" | "vision", "attention" | "mlp"), None for other linears."""
    if path[0] == "layers" and path[1] in ("attn", "mlp"):
        return "language", "attention" if path[1] == "attn" else "mlp"
    if path[:2] == ("vision", "blocks"):
        return "vision", "attention" if path[2] in ("qkv", "proj") else "mlp"
    return None


def finetune_targets(model_type: str, *, finetune_vision_layers: bool = True, finetune_language_layers: bool = True,
                     finetune_attention_modules: bool = True, finetune_mlp_modules: bool = True) -> str:
    """The target_modules regex of the chosen parts (see the module docstring)."""
    halves = {h for h, on in (("vision", finetune_vision_layers), ("language", finetune_language_layers)) if on}
    kinds = {k for k, on in (("attention", finetune_attention_modules), ("mlp", finetune_mlp_modules)) if on}
    if not halves or not kinds:
        raise ConfigError("finetune_vision_layers / finetune_language_layers and finetune_attention_modules / "
                          "finetune_mlp_modules select nothing; set at least one of each pair to true")
    family = family_for(model_type)
    names = []
    for row in family.module_table:
        kind = _kind(row.path) if row.path[-1] == "kernel" and row.hf.endswith(".weight") else None
        if kind and kind[0] in halves and kind[1] in kinds:
            module = re.escape(row.hf[: -len(".weight")])
            names.append(module.replace(re.escape("{i}"), r"\d+").replace(re.escape("{v}"), r"\d+"))
    if not names:
        raise ConfigError(f"model_type={model_type!r} has no {'/'.join(sorted(kinds))} linears in "
                          f"{'/'.join(sorted(halves))} layers")
    return "(?:" + "|".join(names) + ")"
