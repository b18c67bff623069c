"""Model families: what a `model_type` means (config mapping, weight table, the parts of its block).

A family is a `Family` value defined in `jaxft/models/families/<name>.py` (each module exports `FAMILIES`, a
tuple of them, and `HINTS`, {model_type: why it is refused}); the registry below lists the modules. Adding a
family is a new module plus its name in `_MODULES` (and its weight table in `bridge/mappings/`).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Mapping

from bridge.mappings.schema import LoraParamRow, Table
from jaxft.config import ConfigError, ModelConfig
from jaxft.models.parts import BlockParts


@dataclasses.dataclass(frozen=True)
class Family:
    """One HF `model_type`.

    config_from_hf(hf, common) -> the ModelConfig fields this family reads its own way (`common` holds the
    fields every family shares, already parsed, which the family may override); config_to_hf(cfg, out)
    writes them back into the config.json dict `out`. `table` maps HF tensor names to our parameter paths
    (both directions); `parts` is what its decoder layer is assembled from; `lora_parameters` lists the raw
    (non-Linear) parameters LoRA can adapt, PEFT's `target_parameters` (MoE experts), in module order.
    `text_config(hf)`, for a multimodal config.json, is the dict the shared text keys are read from (its
    `text_config` object over the top level). `layouts` are other name tables a checkpoint of the family may
    use (read on load when its tensors are named so; saves write `table`'s names). `modules` names the
    tensors as transformers' modules are named when that differs from the checkpoint (transformers 5 VLMs):
    LoRA sites and PEFT adapter keys use those names."""

    model_type: str
    architecture: str
    table: Table
    parts: BlockParts
    config_from_hf: Callable[[Mapping[str, Any], dict[str, Any]], dict[str, Any]]
    config_to_hf: Callable[[ModelConfig, dict[str, Any]], None]
    lora_parameters: tuple[LoraParamRow, ...] = ()
    text_config: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    layouts: tuple[Table, ...] = ()
    modules: Table | None = None

    @property
    def module_table(self) -> Table:
        """The table whose HF names are transformers' module names (LoRA / PEFT)."""
        return self.table if self.modules is None else self.modules


_MODULES = tuple(importlib.import_module(f"{__name__}.{name}")
                 for name in ("dense", "gemma", "qwen3_moe", "gpt_oss", "qwen2_vl"))

FAMILIES: dict[str, Family] = {f.model_type: f for m in _MODULES for f in m.FAMILIES}
HINTS: dict[str, str] = {k: v for m in _MODULES for k, v in m.HINTS.items()}


def family_for(model_type: str) -> Family:
    """The family of an HF `model_type`; ConfigError naming the supported ones otherwise."""
    try:
        return FAMILIES[model_type]
    except (KeyError, TypeError):
        if model_type in HINTS:
            raise ConfigError(HINTS[model_type]) from None
        raise ConfigError(
            f"model_type={model_type!r} is not supported; supported: {', '.join(FAMILIES)}") from None


__all__ = ["FAMILIES", "Family", "family_for"]
