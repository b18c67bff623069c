"""LoRA's configuration: PEFT's `LoraConfig` fields, validated once."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from bridge import peft as peft_io
from jaxft.errors import ConfigError

ALL_LINEAR = peft_io.ALL_LINEAR


class LoraConfigError(ConfigError):
    """A bad LoRA setting. `field` is the LoraConfig field and `problem` the message without it, so a caller
    with its own key names (TrainConfig's `lora_r`, ...) can state the same problem under its key."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"LoraConfig.{field}: {problem}")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """What to adapt and how, with PEFT's meaning for every field (PEFT names in brackets).

    r [r]: default rank.  alpha [lora_alpha]: default alpha; scale s = alpha / r (alpha / sqrt(r) if
    use_rslora).  dropout [lora_dropout]: dropout on the adapter input during training.
    target_modules: a list of module names, each matching a module whose full HF name equals it or ends with
    "." + it (["q_proj", "v_proj"]); or one regex string that must `re.fullmatch` the full name
    (r".*\\.(q|v)_proj"); or "all-linear": every linear layer except the output head and a vision model's
    patch merger (`visual.merger.mlp.0` / `.mlp.2`, left out by Unsloth's finetune_vision_layers as well: a list
    entry or a regex that names them adapts them).
    rank_pattern / alpha_pattern: {pattern: value}; a module takes the value of the first key (dict order)
    that matches its full name as `(.*\\.)?(key)$` (e.g. {"q_proj": 4, "model.layers.0.mlp.up_proj": 2}).
    exclude_modules: names (list, same rule as target_modules) or a regex removed from the targets.
    target_parameters: raw parameter names (MoE experts: ["experts.gate_up_proj", "experts.down_proj"]), each
    matching a parameter whose full name (`model.layers.0.mlp.experts.down_proj`) equals it or ends with "." +
    it; PEFT's ParamWrapper has no dropout, so dropout must be 0. target_modules may then be None (no modules).
    modules_to_save [modules_to_save]: modules trained in full beside the adapters, by name (same rule as a
    target_modules list): the embeddings ("embed_tokens") and the output head ("lm_head"). On a model with tied
    embeddings each named module gets its own trained copy, as in PEFT, unless ensure_weight_tying
    [ensure_weight_tying] and "embed_tokens" is named: then one trained table serves both.
    trainable_token_indices [trainable_token_indices]: token ids whose embedding rows are trained (the rest
    frozen), or {module name: ids} ("embed_tokens", and "lm_head" on an untied model); a tied head follows the
    embedding's rows.
    Lists are stored as sorted tuples (token ids keep their order) and the pattern dicts are copied (their order
    is kept: first match wins), so a config is hashable (it is static metadata of the model it is applied to).
    """

    r: int = 8
    alpha: float = 8
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = ALL_LINEAR
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = dataclasses.field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = dataclasses.field(default_factory=dict)
    exclude_modules: str | tuple[str, ...] | None = None
    target_parameters: tuple[str, ...] | None = None
    modules_to_save: tuple[str, ...] | None = None
    trainable_token_indices: tuple[int, ...] | Mapping[str, tuple[int, ...]] | None = None
    ensure_weight_tying: bool = False

    def __post_init__(self):
        def bad(field: str, why: str):
            raise LoraConfigError(field, f"value {getattr(self, field)!r} {why}")

        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r <= 0:
            bad("r", "must be a positive integer (the LoRA rank, e.g. 8 or 16)")
        if not _finite_number(self.alpha) or self.alpha <= 0:
            bad("alpha", "must be a positive number (PEFT's lora_alpha; scale = alpha / r)")
        if not _finite_number(self.dropout) or not 0.0 <= self.dropout < 1.0:
            bad("dropout", "must be a number in [0, 1)")
        if not isinstance(self.use_rslora, bool):
            bad("use_rslora", "must be True or False")
        params = self.target_parameters
        if params is not None:
            if isinstance(params, str) or not isinstance(params, (list, tuple, set, frozenset)) or not all(
                    isinstance(n, str) and n for n in params):
                bad("target_parameters", "must be None or a list of parameter names such as "
                    "['experts.gate_up_proj', 'experts.down_proj'] (PEFT has no regex form)")
            params = tuple(sorted(params)) or None  # PEFT keeps a set
            object.__setattr__(self, "target_parameters", params)
        if params and self.dropout:
            bad("dropout", "must be 0 with target_parameters (PEFT's ParamWrapper cannot apply dropout to a raw "
                "parameter)")
        if params and self.target_modules in (None, (), []):
            object.__setattr__(self, "target_modules", None)  # only parameters are adapted
        else:
            object.__setattr__(self, "target_modules",
                               _names_or_regex(self.target_modules, "target_modules", False))
        if isinstance(self.target_modules, str) and self.target_modules.lower() == ALL_LINEAR:
            object.__setattr__(self, "target_modules", ALL_LINEAR)  # PEFT compares case-insensitively
        object.__setattr__(self, "exclude_modules", _names_or_regex(self.exclude_modules, "exclude_modules", True))
        for field, ok, what in (("rank_pattern", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
                                 "a positive integer rank"),
                                ("alpha_pattern", lambda v: _finite_number(v) and v > 0, "a positive number")):
            pattern = getattr(self, field)
            if not isinstance(pattern, Mapping):
                bad(field, "must be a dict {module name pattern: value}")
            for key, value in pattern.items():
                if not isinstance(key, str) or not key:
                    raise LoraConfigError(field, f"key {key!r} must be a non-empty string")
                _compile(key, f"LoraConfig.{field} key")
                if not ok(value):
                    raise LoraConfigError(field, f"value {value!r} of {key!r} must be {what}")
            object.__setattr__(self, field, dict(pattern))
        saved = self.modules_to_save
        if saved is not None:
            if isinstance(saved, str) or not isinstance(saved, (list, tuple, set, frozenset)) or not all(
                    isinstance(n, str) and n for n in saved):
                bad("modules_to_save", "must be None or a list of module names such as ['embed_tokens', 'lm_head']")
            object.__setattr__(self, "modules_to_save", tuple(sorted(set(saved))) or None)
        object.__setattr__(self, "trainable_token_indices", _token_indices(self.trainable_token_indices))
        if not isinstance(self.ensure_weight_tying, bool):
            bad("ensure_weight_tying", "must be True or False")

    @property
    def token_index_map(self) -> dict[str, tuple[int, ...]]:
        """trainable_token_indices as {module name: ids} (a bare list names the embeddings, as in PEFT)."""
        ids = self.trainable_token_indices
        if ids is None:
            return {}
        return dict(ids) if isinstance(ids, Mapping) else {"embed_tokens": ids}

    def __hash__(self) -> int:
        return hash((self.r, self.alpha, self.dropout, self.target_modules, self.use_rslora,
                     frozenset(self.rank_pattern.items()), frozenset(self.alpha_pattern.items()), self.exclude_modules,
                     self.target_parameters, self.modules_to_save, tuple(self.token_index_map.items()),
                     self.ensure_weight_tying))

    def scale(self, rank: int, alpha: float) -> float:
        """The LoRA scale of a module of this rank and alpha: alpha / r, or alpha / sqrt(r) under rsLoRA."""
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def peft_fields(self) -> dict[str, Any]:
        """The fields under their PEFT `LoraConfig` names (lists as lists): `peft.LoraConfig(**cfg.peft_fields())`."""
        def listed(v):
            return list(v) if isinstance(v, tuple) else v
        return dict(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                    target_modules=listed(self.target_modules), use_rslora=self.use_rslora,
                    rank_pattern=dict(self.rank_pattern), alpha_pattern=dict(self.alpha_pattern),
                    exclude_modules=listed(self.exclude_modules), target_parameters=listed(self.target_parameters),
                    modules_to_save=listed(self.modules_to_save),
                    trainable_token_indices=(None if self.trainable_token_indices is None else
                                             {k: list(v) for k, v in self.trainable_token_indices.items()}
                                             if isinstance(self.trainable_token_indices, Mapping)
                                             else list(self.trainable_token_indices)),
                    ensure_weight_tying=self.ensure_weight_tying)

    @classmethod
    def from_peft(cls, peft: Mapping[str, Any]) -> "LoraConfig":
        """From a PEFT adapter config dict (`adapter_config.json`; PEFT field names such as lora_alpha)."""
        return cls(r=peft["r"], alpha=peft["lora_alpha"], dropout=peft.get("lora_dropout", 0.0) or 0.0,
                   target_modules=peft["target_modules"], use_rslora=bool(peft.get("use_rslora", False)),
                   rank_pattern=peft.get("rank_pattern") or {}, alpha_pattern=peft.get("alpha_pattern") or {},
                   exclude_modules=peft.get("exclude_modules") or None,
                   target_parameters=peft.get("target_parameters") or None,
                   modules_to_save=peft.get("modules_to_save") or None,
                   trainable_token_indices=peft.get("trainable_token_indices") or None,
                   ensure_weight_tying=bool(peft.get("ensure_weight_tying", False)))


def _token_ids(value, where: str) -> tuple[int, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise LoraConfigError("trainable_token_indices", f"{where}{value!r} must be a non-empty list of token ids "
                              "(non-negative integers), e.g. [128000, 128001]")
    if len(set(value)) != len(value):
        raise LoraConfigError("trainable_token_indices", f"{where}{value!r} lists a token id twice")
    return tuple(value)


def _token_indices(value):
    """None, a tuple of ids (the embeddings' rows), or {module name: tuple of ids} (PEFT's two forms)."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        if not value or not all(isinstance(k, str) and k for k in value):
            raise LoraConfigError("trainable_token_indices", f"value {value!r}: a dict must map module names "
                                  "(embed_tokens, lm_head) to lists of token ids")
        return {k: _token_ids(v, f"{k!r}: ") for k, v in value.items()}
    return _token_ids(value, "value ")


def _finite_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _compile(pattern: str, what: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"{what} {pattern!r} is not a valid regular expression ({e})") from None


def _names_or_regex(value, field: str, optional: bool):
    if value is None and optional:
        return None
    if isinstance(value, str):
        if not value:
            raise LoraConfigError(field, "is an empty string; give a regex, a list of names or 'all-linear'")
        _compile(value, f"LoraConfig.{field}")
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        names = tuple(sorted(value))  # order has no meaning (PEFT keeps a set): sorted, so equal configs compare equal
        if (names or not optional) and not (names and all(isinstance(n, str) and n for n in names)):
            raise LoraConfigError(field, f"value {value!r} must be a non-empty list of module names such as "
                                         "['q_proj', 'v_proj'], a regex string" + (", or None" if optional else
                                                                                    " or 'all-linear'"))
        return names or None
    raise LoraConfigError(field, f"value {value!r} must be a list of module names or a regex string")


