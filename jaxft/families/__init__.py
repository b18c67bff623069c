"""Model families: what a `model_type` means (config mapping, weight table, the parts of its block).

A family is a `Family` value defined in `jaxft/families/<name>.py` (each module exports `FAMILIES`, a
tuple of them, and `HINTS`, {model_type: why it is refused}); the registry below lists the modules. Adding a
family is a new module, imported here and named in `_MODULES` (and its weight table in `bridge/mappings/`).
"""

from __future__ import annotations

from jaxft.errors import ConfigError
from jaxft.families import dense, gemma, gpt_oss, qwen2_vl, qwen3_moe
from jaxft.families.family import BlockParts, Family

_MODULES = (dense, gemma, qwen3_moe, gpt_oss, qwen2_vl)

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


__all__ = ["FAMILIES", "BlockParts", "Family", "family_for"]
