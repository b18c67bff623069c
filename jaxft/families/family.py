"""What a family is: a `Family` (one HF `model_type`: config mapping, weight tables, block parts) and the
`BlockParts` its decoder layer is assembled from. Plain data, below the model config that reads it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from bridge.mappings.schema import LoraParamRow, Table


@dataclasses.dataclass(frozen=True)
class BlockParts:
    """Which shared parts a family's layer is made of (what config.json does not say, the architecture does)."""

    norm_offset: bool = False  # RMSNorm weights are offsets: x_hat * (1 + w), in fp32 (Gemma)
    sandwich_norms: bool = False  # attention and MLP outputs are normalised before their residual add (Gemma 2/3)
    mlp: str = "glu"  # the MLP slot (`MLPS`); a mixture-of-experts MLP registers there
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), the factor rounded to the dtype (Gemma)


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
    config_to_hf: Callable[[Any, dict[str, Any]], None]  # (a jaxft.config.ModelConfig, out)
    lora_parameters: tuple[LoraParamRow, ...] = ()
    text_config: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    layouts: tuple[Table, ...] = ()
    modules: Table | None = None

    @property
    def module_table(self) -> Table:
        """The table whose HF names are transformers' module names (LoRA / PEFT)."""
        return self.table if self.modules is None else self.modules
