"""LoRA on jaxft models with PEFT's semantics, and PEFT adapter import/export.

For a targeted linear layer with frozen kernel W [in, out], layer l of the stack computes

    y = x W + s_l * (dropout(x) A_l) B_l,      A_l [in, r_max], B_l [r_max, out] (fp32, `LoraParam`)
    s_l = alpha_l / r_l        (rsLoRA: alpha_l / sqrt(r_l));   s_l = 0 where layer l's module is not targeted

PEFT's `lora_A.weight` [r, in] is A_l[:, :r_l].T and `lora_B.weight` [out, r] is B_l[:r_l, :].T. Layers of a
stack may differ in rank (`rank_pattern`): the stack is allocated at the largest rank r_max and the columns
r_l..r_max of A_l / rows of B_l are zero (see `jaxft.lora.apply._random_fill` for why they stay zero during training).

Which modules are targeted is decided on Hugging Face module names (`model.layers.3.self_attn.q_proj`), with
PEFT's rules (`bridge.peft.target_matches`, `pattern_key`), so a `LoraConfig` selects exactly the modules the
equivalent `peft.LoraConfig` selects. The HF name <-> jaxft path correspondence comes from the bridge's
mapping table (rows `<module>.weight` -> `<path>.kernel`): one source of truth for checkpoints and adapters.

MoE experts are raw 3-D parameters in transformers, adapted by PEFT's `target_parameters`
(`LoraConfig.target_parameters=("experts.gate_up_proj", "experts.down_proj")`): each becomes a
`jaxft.models.moe.ExpertLora` (A [L, E, in, r], B [L, E, r, out]) at the path the family's `lora_parameters`
rows name; PEFT's packed [r*E, in] / [out, r*E] layout is converted in `save_adapter` / `load_adapter`.

Beside the adapters, `modules_to_save` trains the embeddings / output head in full and `trainable_token_indices`
trains single rows of them (`jaxft.lora.trained`, PEFT's semantics and file format).

The package: `config` (LoraConfig), `targets` (which modules a config selects), `apply` (install and merge
adapters), `trained` (tables and rows trained beside them), `adapter_files` (PEFT's files, both ways).
"""

from jaxft.lora.adapter_files import load_adapter, save_adapter
from jaxft.lora.apply import apply_lora, lora_state, merge_lora, merged_kernels
from jaxft.lora.config import ALL_LINEAR, LoraConfig, LoraConfigError
from jaxft.lora.targets import target_names
from jaxft.lora.trained import new_token_config, resize_embeddings
from jaxft.models.layers import LoraParam, TrainableParam

__all__ = [
    "ALL_LINEAR",
    "LoraConfig",
    "LoraConfigError",
    "LoraParam",
    "TrainableParam",
    "apply_lora",
    "load_adapter",
    "lora_state",
    "merge_lora",
    "merged_kernels",
    "new_token_config",
    "resize_embeddings",
    "save_adapter",
    "target_names",
    "trainable_filter",
]

# The variable type the optimiser updates: `nnx.state(model, trainable_filter)` / `nnx.DiffState(0, ...)`.
trainable_filter = TrainableParam
