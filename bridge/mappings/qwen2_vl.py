"""Name maps for Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`).

The names are the checkpoint's, which are not the module names of transformers 5: its model nests the text
model under `model.language_model` and the tower under `model.visual`, but `save_pretrained` writes (and the
Hub checkpoints hold) the older layout, which `from_pretrained` renames on load (its conversion mapping for
Qwen2VLForConditionalGeneration: `^visual` -> `model.visual`, `^model` -> `model.language_model`):

    text:    model.embed_tokens / model.layers.{i}.* / model.norm / lm_head     (the dense Qwen2 rows)
    vision:  visual.patch_embed.proj.weight  [E, C, T, P, P]  (kept as stored: the tower flattens it)
             visual.blocks.{v}.{norm1,norm2,attn.qkv,attn.proj,mlp.*}          ({v}: vision block)
             visual.merger.{ln_q, mlp.0, mlp.2}

2-VL blocks: LayerNorm norms (weight + bias), mlp.fc1 / mlp.fc2; 2.5-VL: RMSNorm norms (weight), SwiGLU
mlp.gate_proj / up_proj / down_proj, every vision linear biased.
"""

from __future__ import annotations

from bridge.mappings import dense
from bridge.mappings.schema import Row, Table, validate_table

_B = "visual.blocks.{v}."
_V = ("vision", "blocks")


def _linear(hf: str, path: tuple[str, ...], stacked_prefix: str = _B, ours: tuple[str, ...] = _V) -> tuple[Row, ...]:
    return (Row(stacked_prefix + hf + ".weight", (*ours, *path, "kernel"), "T", False),
            Row(stacked_prefix + hf + ".bias", (*ours, *path, "bias"), None, False))


def _norm(hf: str, path: tuple[str, ...], prefix: str = _B, ours: tuple[str, ...] = _V) -> tuple[Row, ...]:
    return (Row(prefix + hf + ".weight", (*ours, *path, "scale"), None, False),
            Row(prefix + hf + ".bias", (*ours, *path, "bias"), None, False))


VISION: Table = (
    Row("visual.patch_embed.proj.weight", ("vision", "patch_embed", "kernel"), None, False),
    *_norm("norm1", ("norm1",)), *_norm("norm2", ("norm2",)),
    *_linear("attn.qkv", ("qkv",)), *_linear("attn.proj", ("proj",)),
    *_linear("mlp.fc1", ("fc1",)), *_linear("mlp.fc2", ("fc2",)),
    *_linear("mlp.gate_proj", ("gate_proj",)), *_linear("mlp.up_proj", ("up_proj",)),
    *_linear("mlp.down_proj", ("down_proj",)),
    *_norm("ln_q", ("ln_q",), "visual.merger.", ("vision", "merger")),
    *_linear("mlp.0", ("fc1",), "visual.merger.", ("vision", "merger")),
    *_linear("mlp.2", ("fc2",), "visual.merger.", ("vision", "merger")),
)

# Both models: the Qwen2 text rows plus the tower's; which rows a model has is decided by its parameters.
TABLE: Table = validate_table(tuple(dense.TABLE) + VISION)


# transformers 5's module names: what `save_pretrained(save_original_format=False)` writes. Read on load (the
# first layout whose names a checkpoint holds is used); saves write TABLE's names, as transformers does.
_V5_PREFIXES = (("visual.", "model.visual."), ("model.", "model.language_model."))


def _v5(name: str) -> str:
    for old, new in _V5_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


V5_TABLE: Table = validate_table(tuple(Row(_v5(r.hf), r.path, r.transform, r.stacked) for r in TABLE))
