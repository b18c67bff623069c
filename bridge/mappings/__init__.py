"""Per-architecture HF <-> tree name tables (data, used for load and save)."""

from __future__ import annotations

from bridge.mappings import dense, gemma, gpt_oss, qwen2_vl, qwen3_moe
from bridge.mappings.schema import Row, Table, validate_table

# HF `config.json["model_type"]` -> table.
TABLES: dict[str, Table] = {
    "llama": dense.TABLE,
    "mistral": dense.TABLE,
    "qwen2": dense.TABLE,
    "qwen3": dense.TABLE,
    "gemma2": gemma.TABLE, "gemma3_text": gemma.TABLE,
    "qwen3_moe": qwen3_moe.TABLE,
    "gpt_oss": gpt_oss.TABLE,
    "qwen2_vl": qwen2_vl.TABLE, "qwen2_5_vl": qwen2_vl.TABLE,
}


def table_for(model_type: str) -> Table:
    """The mapping table for an HF ``model_type`` (from config.json)."""
    try:
        return TABLES[model_type]
    except (KeyError, TypeError):
        supported = ", ".join(sorted(TABLES))
        raise ValueError(
            f"unsupported model_type {model_type!r} (config.json 'model_type'); supported: {supported}. "
            "To add one, write its table in bridge/mappings/ and register it in TABLES."
        ) from None


__all__ = ["Row", "TABLES", "Table", "table_for", "validate_table"]
