"""LoRA on jaxft models with PEFT's semantics, and PEFT adapter import/export.

For a targeted linear layer with frozen kernel W [in, out], layer l of the stack computes

    y = x W + s_l * (dropout(x) A_l) B_l,      A_l [in, r_max], B_l [r_max, out] (fp32, `LoraParam`)
    s_l = alpha_l / r_l        (rsLoRA: alpha_l / sqrt(r_l));   s_l = 0 where layer l's module is not targeted

PEFT's `lora_A.weight` [r, in] is A_l[:, :r_l].T and `lora_B.weight` [out, r] is B_l[:r_l, :].T. Layers of a
stack may differ in rank (`rank_pattern`): the stack is allocated at the largest rank r_max and the columns
r_l..r_max of A_l / rows of B_l are zero (see `_random_fill` for why they stay zero during training).

Which modules are targeted is decided on Hugging Face module names (`model.layers.3.self_attn.q_proj`), with
PEFT's rules (`bridge.peft.target_matches`, `pattern_key`), so a `LoraConfig` selects exactly the modules the
equivalent `peft.LoraConfig` selects. The HF name <-> jaxft path correspondence comes from the bridge's
mapping table (rows `<module>.weight` -> `<path>.kernel`): one source of truth for checkpoints and adapters.

MoE experts are raw 3-D parameters in transformers, adapted by PEFT's `target_parameters`
(`LoraConfig.target_parameters=("experts.gate_up_proj", "experts.down_proj")`): each becomes a
`jaxft.models.moe.ExpertLora` (A [L, E, in, r], B [L, E, r, out]) at the path the family's `lora_parameters`
rows name; PEFT's packed [r*E, in] / [out, r*E] layout is converted in `save_adapter` / `load_adapter`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bridge import peft as peft_io
from bridge.mappings.schema import LAYER, VISION_BLOCK
from jaxft.config import ConfigError
from jaxft.models.families import family_for
from jaxft.models.layers import ExpertParam, Linear, LoraParam, LoraRank, LoraScale, linears, logical
from jaxft.models.moe import ExpertLora, expert_adapters
from jaxft.models.quant_experts import Quant4bitExperts, expert_weight
from jaxft.models.stack import layer_stacks

__all__ = [
    "LoraConfig",
    "apply_lora",
    "load_adapter",
    "lora_state",
    "merge_lora",
    "merged_kernels",
    "save_adapter",
    "target_names",
    "trainable_filter",
]

ALL_LINEAR = peft_io.ALL_LINEAR

# The variable type the optimiser updates: `nnx.state(model, trainable_filter)` / `nnx.DiffState(0, ...)`.
trainable_filter = LoraParam


# --------------------------------------------------------------------------- config


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
    Lists are stored as sorted tuples and the pattern dicts are copied (their order is kept: first match wins),
    so a config is hashable (it is static metadata of the model it is applied to).
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

    def __hash__(self) -> int:
        return hash((self.r, self.alpha, self.dropout, self.target_modules, self.use_rslora,
                     frozenset(self.rank_pattern.items()), frozenset(self.alpha_pattern.items()), self.exclude_modules,
                     self.target_parameters))

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
                    exclude_modules=listed(self.exclude_modules), target_parameters=listed(self.target_parameters))

    @classmethod
    def from_peft(cls, peft: Mapping[str, Any]) -> "LoraConfig":
        """From a PEFT adapter config dict (`adapter_config.json`; PEFT field names such as lora_alpha)."""
        return cls(r=peft["r"], alpha=peft["lora_alpha"], dropout=peft.get("lora_dropout", 0.0) or 0.0,
                   target_modules=peft["target_modules"], use_rslora=bool(peft.get("use_rslora", False)),
                   rank_pattern=peft.get("rank_pattern") or {}, alpha_pattern=peft.get("alpha_pattern") or {},
                   exclude_modules=peft.get("exclude_modules") or None,
                   target_parameters=peft.get("target_parameters") or None)


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


# --------------------------------------------------------------------------- HF module names <-> our linears


@dataclasses.dataclass(frozen=True)
class _Site:
    """One jaxft Linear (a stack of per-layer linears) and the HF module name of each of its layers: row r of
    the stack is HF layer `layers[r]` (`jaxft.models.stack.layer_stacks`; a model with dense and sparse layers
    has one site per stack for the same template)."""

    path: tuple[str, ...]  # ("layers", "attn", "q_proj")
    template: str  # "model.layers.{i}.self_attn.q_proj"
    stacked: bool
    layers: tuple[int, ...] = ()
    slot: str = LAYER  # the placeholder `layers` fill: "{i}", or "{v}" for a vision tower's blocks
    # Selected only by name (a target_modules list or regex), never by "all-linear": the vision merger, which
    # Unsloth's finetune_vision_layers leaves out as well (a linear seen once, like a head).
    by_name_only: bool = False

    def names(self) -> list[str]:
        """The HF module name of each row of the stack."""
        if not self.stacked:
            return [self.template]
        return [self.template.replace(self.slot, str(i)) for i in self.layers]


@dataclasses.dataclass(frozen=True)
class _Modules:
    sites: tuple[_Site, ...]  # per-layer linears LoRA can target
    unsupported: dict[str, str]  # HF module name -> why LoRA cannot go there (output head, non-linear modules)
    head: frozenset[str]  # the output head's name(s): adapter weights there cannot be represented at all
    params: tuple[_Site, ...] = ()  # raw expert parameters (target_parameters), in the HF module's order

    def linear_names(self) -> Iterator[tuple[str, _Site, int]]:
        """(HF module name, site, row of the site's stack) of every linear."""
        for site in self.sites:
            for row, name in enumerate(site.names()):
                yield name, site, row

    def param_names(self) -> Iterator[tuple[str, _Site, int]]:
        """(full parameter name, site, row), HF layer by layer and in module order within a layer (the order
        PEFT nests its wrappers in, see `bridge.peft.param_wrapper_keys`)."""
        entries = [(layer, k, name, site, row) for k, site in enumerate(self.params)
                   for row, (layer, name) in enumerate(zip(site.layers, site.names()))]
        for _, _, name, site, row in sorted(entries, key=lambda e: e[:2]):
            yield name, site, row


def _modules(model) -> _Modules:
    """Our linears under their HF names, derived from the bridge table rows `<module>.weight -> <path>.kernel`."""
    cfg = model.config
    table = family_for(cfg.model_type).module_table
    present = {tuple(path.split(".")) for path, _ in linears(model)}
    stacks = layer_stacks(cfg)
    sites, unsupported, head = [], {}, set()
    for row in table:
        if not row.hf.endswith(".weight") or "e" in row.axes:  # expert tensors are not Linear modules
            continue
        if row.stacked and row.stack not in stacks:  # a stack this model does not have (no dense layers)
            continue
        module = row.hf[: -len(".weight")]
        if row.path[0] == "vision":  # the vision tower: its blocks are a stack of their own ({v})
            if row.path[-1] == "kernel" and row.path[:-1] in present and "v" in row.axes:
                sites.append(_Site(row.path[:-1], module, True, tuple(range(cfg.vision.depth)),
                                   VISION_BLOCK))
            elif row.path[-1] == "kernel" and row.path[:-1] in present:  # the merger's two linears
                sites.append(_Site(row.path[:-1], module, False, by_name_only=True))
            continue
        layers = stacks[row.stack] if row.stacked else ()
        names = _Site(row.path[:-1], module, row.stacked, layers).names()
        if row.path[-1] == "kernel" and row.path[:-1] in present and row.stacked:
            sites.append(_Site(row.path[:-1], module, True, layers))
        elif row.path[-1] == "kernel":
            why = ("the output head: LoRA on it is not supported (the fused loss reads its kernel directly); "
                   "remove it from target_modules")
            unsupported.update({n: why for n in names})
            head.update(names)
        else:
            why = "not a linear layer: jaxft supports LoRA on linear layers only (no embedding or norm LoRA)"
            unsupported.update({n: why for n in names})
    params = tuple(_Site(row.path, row.hf, True, stacks[row.path[0]])
                   for row in family_for(cfg.model_type).lora_parameters if row.path[0] in stacks)
    return _Modules(tuple(sites), unsupported, frozenset(head), params)


def _short_names(mods: _Modules) -> list[str]:
    return [site.template.rsplit(".", 1)[-1] for site in mods.sites]


def _no_match_error(what: str, mods: _Modules, model_type: str, regex: bool) -> ConfigError:
    example = mods.sites[0].names()[0] if mods.sites else "?"
    hint = (" A string is a regex that must match the WHOLE name (re.fullmatch); to match by name pass a list, "
            "e.g. ['q_proj', 'v_proj'].") if regex else ""
    return LoraConfigError(
        "target_modules", f"{what} matches no linear module of this {model_type} model. Linear "
        f"modules: {', '.join(_short_names(mods))} (each names every layer's module; full names look like "
        f"{example!r}).{hint}")


def _plan(model, cfg: LoraConfig, *, strict: bool) -> dict[_Site, list[tuple[int, float] | None]]:
    """{site: per layer (rank, scale) or None when that layer's module is not targeted}; linear sites from
    target_modules, expert-parameter sites from target_parameters.

    strict (apply_lora): every target list entry, exclude entry and pattern key must select something, and a
    match on a module LoRA cannot adapt is an error. Lenient (load_adapter): like PEFT, only an adapter that
    targets nothing, or that targets an unsupported module, is an error.
    """
    mods = _modules(model)
    model_type = model.config.model_type
    targets = cfg.target_modules
    kept = _plan_linears(mods, cfg, model_type, strict) if targets is not None else []
    if cfg.target_parameters:
        kept += _plan_params(mods, cfg, model_type, strict)

    peft_like = dict(r=cfg.r, lora_alpha=cfg.alpha, rank_pattern=cfg.rank_pattern, alpha_pattern=cfg.alpha_pattern)
    plan: dict[_Site, list[tuple[int, float] | None]] = {}
    for name, site, layer in kept:
        rank, alpha = peft_io.module_rank_alpha(peft_like, name)
        plan.setdefault(site, [None] * len(site.names()))[layer] = (rank, cfg.scale(rank, alpha))
    if strict:
        for field in ("rank_pattern", "alpha_pattern"):
            for key in getattr(cfg, field):
                if not any(peft_io.pattern_key({key: 0}, n) for n, _, _ in kept):
                    raise ConfigError(f"LoraConfig.{field} key {key!r} matches none of the targeted modules (e.g. "
                                      f"{kept[0][0]!r}); keys match a full name as '(.*\\.)?(key)$'")
    return plan


def _plan_linears(mods: _Modules, cfg: LoraConfig, model_type: str, strict: bool) -> list[tuple[str, _Site, int]]:
    """The (name, site, layer) of every linear module target_modules selects and exclude_modules keeps."""
    targets = cfg.target_modules
    entries = list(mods.linear_names())

    def selected(name: str, site: _Site | None = None) -> bool:
        if targets == ALL_LINEAR:
            return site is not None and not site.by_name_only
        return peft_io.target_matches(name, targets)

    bad = {name: why for name, why in mods.unsupported.items() if targets != ALL_LINEAR and selected(name)}
    bad = {n: w for n, w in bad.items() if not peft_io.is_excluded(n, cfg.exclude_modules)}
    # Lenient mode still refuses the head: PEFT would have trained weights there that we cannot apply.
    fatal = bad if strict else {n: w for n, w in bad.items() if n in mods.head}
    if fatal:
        name = next(iter(fatal))
        raise ConfigError(f"LoraConfig.target_modules={_show(targets)} selects {name!r}, which is {bad[name]}")
    if strict and isinstance(targets, tuple):
        for t in targets:
            if not any(peft_io.target_matches(n, (t,)) for n, _, _ in entries):
                raise _no_match_error(repr(t), mods, model_type, regex=False)

    chosen = [(n, s, l) for n, s, l in entries if selected(n, s)]
    kept = [(n, s, l) for n, s, l in chosen if not peft_io.is_excluded(n, cfg.exclude_modules)]
    if not chosen:
        raise _no_match_error(_show(targets), mods, model_type, regex=isinstance(targets, str))
    if not kept:
        raise ConfigError(f"LoraConfig.exclude_modules={_show(cfg.exclude_modules)} removes every module that "
                          f"target_modules={_show(targets)} selects; nothing would be adapted")
    if strict and cfg.exclude_modules and len(kept) == len(chosen):
        raise ConfigError(f"LoraConfig.exclude_modules={_show(cfg.exclude_modules)} excludes none of the targeted "
                          f"modules (e.g. {chosen[0][0]!r}); fix the names or drop it")
    return kept


def _plan_params(mods: _Modules, cfg: LoraConfig, model_type: str, strict: bool) -> list[tuple[str, _Site, int]]:
    """The (name, site, layer) of every expert parameter target_parameters selects (PEFT's matching rule: the
    full name equals an entry or ends with "." + it)."""
    entries = list(mods.param_names())
    wanted = cfg.target_parameters
    unmatched = [t for t in wanted if not any(peft_io.target_matches(n, (t,)) for n, _, _ in entries)]
    if unmatched and (strict or len(unmatched) == len(wanted)):
        if not mods.params:
            raise LoraConfigError("target_parameters", f"{unmatched[0]!r}: this {model_type} model has no raw "
                                  "parameters LoRA can target (they are MoE expert weights); use target_modules")
        short = ", ".join(".".join(s.template.split(".")[-2:]) for s in mods.params)
        raise LoraConfigError("target_parameters", f"{unmatched[0]!r} matches no parameter of this {model_type} "
                              f"model; expert parameters: {short} (full names look like {entries[0][0]!r})")
    return [(n, s, l) for n, s, l in entries if peft_io.target_matches(n, wanted)]


def _show(value) -> str:
    return repr(list(value) if isinstance(value, tuple) else value)


def target_names(model, cfg: LoraConfig) -> list[str]:
    """The HF module names `cfg` adapts on `model` (what PEFT would wrap), by module type (table order), then layer."""
    plan = _plan(model, cfg, strict=True)
    mods = _modules(model)
    names = [*mods.linear_names(), *mods.param_names()]
    return [n for n, site, layer in names if plan.get(site) and plan[site][layer]]


# --------------------------------------------------------------------------- apply / merge


def _linear(model, path: tuple[str, ...]) -> Linear:
    node = model
    for part in path:
        node = getattr(node, part)
    return node


def _like_kernel(x: jax.Array, kernel: jax.Array, axes: tuple[int | None, ...]) -> jax.Array:
    """Place `x` sharded like `kernel` along the mapped axes (`axes[d]` = kernel axis of x's dim d, or None)."""
    sharding = getattr(kernel, "sharding", None)  # None for a 4-bit linear (no kernel): placed as is
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return x
    spec = tuple(sharding.spec) + (None,) * (kernel.ndim - len(sharding.spec))
    new = jax.sharding.PartitionSpec(*(None if a is None else spec[a] for a in axes))
    return jax.device_put(x, jax.sharding.NamedSharding(sharding.mesh, new))


def _random_fill(seed: int):
    """PEFT's init: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0.

    Columns j >= r_l of A_l and rows j >= r_l of B_l (padding up to r_max, and everything in layers whose module
    is not targeted) start at exactly zero and get exactly zero gradients, so they stay zero under any optimiser
    whose update of a zero parameter with a zero gradient is zero (SGD, Adam/AdamW incl. decoupled weight decay):
    with g = dL/dy (times s_l), dL/dA_l[:, j] = x^T g B_l[j, :]^T = 0 because row j of B_l is 0, and
    dL/dB_l[j, :] = (x A_l[:, j])^T g = 0 because column j of A_l is 0. (For untargeted layers s_l = 0 as well.)
    """
    def fill(index: int, site: _Site, shape: tuple[int, ...], ranks: np.ndarray):
        # shape: the per-layer weight, [in, out] or [E, in, out] (experts: PEFT's lora_A is one nn.Linear(in,
        # r*E), so its bound is 1/sqrt(in) as well). Drawn on the host (numpy): no XLA program to compile per
        # adapter shape, and A is small ([L, (E,) in, r]).
        *lead, n_in, n_out = shape
        r_max = int(ranks.max())
        bound = 1.0 / math.sqrt(n_in)
        rng = np.random.default_rng([seed, index])
        a = rng.uniform(-bound, bound, (len(ranks), *lead, n_in, r_max)).astype(np.float32)
        a *= (np.arange(r_max) < ranks.reshape(-1, *[1] * (len(lead) + 2)))
        return jnp.asarray(a), jnp.zeros((len(ranks), *lead, r_max, n_out), jnp.float32)
    return fill


def _ranks_scales(per_layer) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([p[0] if p else 0 for p in per_layer], np.int32),
            np.array([p[1] if p else 0.0 for p in per_layer], np.float32))


def _expert_shape(holder, slot: str) -> tuple[int, int, int]:
    """(E, in, out) of the expert weight an adapter slot of a MoE MLP adapts."""
    return tuple(getattr(holder, holder.LORA_KERNELS[slot]).shape[-3:])


def _install(model, cfg: LoraConfig, plan, fill) -> None:
    if any(lin.has_lora for _, lin in linears(model)) or expert_adapters(model):
        raise ValueError("the model already has LoRA adapters; merge_lora(model) first to stack a new adapter on "
                         "the merged weights, or start from a freshly loaded base model")
    mods = _modules(model)
    for index, site in enumerate(mods.params, start=len(mods.sites)):
        if site not in plan:
            continue
        holder, slot = _linear(model, site.path[:-1]), site.path[-1]
        ranks, scales = _ranks_scales(plan[site])
        a, b = fill(index, site, _expert_shape(holder, slot), ranks)
        kernel = getattr(holder, holder.LORA_KERNELS[slot])
        kernel = kernel[...] if isinstance(kernel, ExpertParam) else None  # 4-bit experts: placed as is
        adapter = ExpertLora(_like_kernel(a, kernel, (0, 1, 2, None)), _like_kernel(b, kernel, (0, 1, None, None)),
                             _like_kernel(jnp.asarray(scales), kernel, (0,)),
                             _like_kernel(jnp.asarray(ranks), kernel, (0,)))
        setattr(holder, slot, nnx.data(adapter))
    for index, site in enumerate(mods.sites):
        per_layer = plan.get(site)
        if per_layer is None:
            continue
        lin = _linear(model, site.path)
        ranks, scales = _ranks_scales(per_layer)
        a, b = fill(index, site, (lin.in_features, lin.out_features), ranks)
        kernel = lin.kernel[...] if lin.quant is None else None
        ranks, scales = jnp.asarray(ranks), jnp.asarray(scales)
        # `nnx.data`: these attributes were None (static) on the fresh Linear and now hold state.
        # Logical axes as the kernel's: A [layers, in, rank], B [layers, rank, out] (jaxft.sharding's rules);
        # a linear outside any stack (the vision merger) has A [in, rank], B [rank, out] and scalar scale/rank.
        lin_in, lin_out = lin.axes
        if not site.stacked:
            a, b, ranks, scales = a[0], b[0], ranks[0], scales[0]
            lin.lora_a = nnx.data(LoraParam(_like_kernel(a, kernel, (0, None)), **logical(lin_in, "lora_rank")))
            lin.lora_b = nnx.data(LoraParam(_like_kernel(b, kernel, (None, 1)), **logical("lora_rank", lin_out)))
            lin.lora_scale, lin.lora_rank = nnx.data(LoraScale(scales)), nnx.data(LoraRank(ranks))
        else:
            lin.lora_a = nnx.data(LoraParam(_like_kernel(a, kernel, (0, 1, None)),
                                            **logical("layers", lin_in, "lora_rank")))
            lin.lora_b = nnx.data(LoraParam(_like_kernel(b, kernel, (0, None, 2)),
                                            **logical("layers", "lora_rank", lin_out)))
            lin.lora_scale = nnx.data(LoraScale(_like_kernel(scales, kernel, (0,)), **logical("layers")))
            lin.lora_rank = nnx.data(LoraRank(_like_kernel(ranks, kernel, (0,)), **logical("layers")))
        lin.lora_dropout = float(cfg.dropout)
    # Static metadata (hashable), kept through nnx.split/merge; save_adapter writes it back as adapter_config.
    model.lora_config = cfg


def apply_lora(model, cfg: LoraConfig, *, seed: int = 0):
    """Adds LoRA adapters to `model` in place (and returns it): A ~ U(+-1/sqrt(in)), B = 0, fp32.

    Raises ConfigError if a target_modules entry, an exclude_modules value or a rank/alpha pattern key selects
    nothing, or selects a module LoRA cannot adapt (output head, embeddings, norms).
    """
    if not isinstance(cfg, LoraConfig):
        raise TypeError(f"apply_lora needs a jaxft.lora.LoraConfig, got {type(cfg).__name__}; for a PEFT config "
                        "dict use LoraConfig.from_peft(d)")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"apply_lora(seed={seed!r}): the seed must be a non-negative integer")
    _install(model, cfg, _plan(model, cfg, strict=True), _random_fill(seed))
    return model


@jax.jit
def _merged(kernel, a, b, scale):
    """W + s_l * A_l B_l per layer, accumulated in fp32, returned in the kernel's dtype."""
    delta = jnp.einsum("lir,lro->lio", a, b, precision=jax.lax.Precision.HIGHEST)
    return (kernel.astype(jnp.float32) + scale[:, None, None] * delta).astype(kernel.dtype)


@jax.jit
def _merged_experts(kernel, a, b, scale):
    """W_e + s_l * A_e B_e per layer and expert, accumulated in fp32, returned in the kernel's dtype."""
    delta = jnp.einsum("leir,lero->leio", a, b, precision=jax.lax.Precision.HIGHEST)
    return (kernel.astype(jnp.float32) + scale[:, None, None, None] * delta).astype(kernel.dtype)


def _expert_merges(model) -> dict[tuple[str, ...], tuple]:
    """{expert kernel path: (MoE MLP, kernel attribute, ExpertLora)} for every adapted expert kernel."""
    out = {}
    for path, adapter in expert_adapters(model):
        *owner, slot = path.split(".")
        holder = _linear(model, tuple(owner))
        name = holder.LORA_KERNELS[slot]
        out[(*owner, name)] = (holder, name, adapter)
    return out


class _MergedKernels(Mapping):
    """{kernel path: merged kernel}, each computed when it is read, so a caller that moves one to host at a time
    holds one extra kernel at a time on the device."""

    def __init__(self, model):
        self._dtype = getattr(model, "dtype", None)
        self._lins = {(*tuple(p.split(".")), "kernel"): lin for p, lin in linears(model) if lin.has_lora}
        self._experts = _expert_merges(model)

    def __getitem__(self, key):
        key = tuple(key)
        if key in self._experts:
            holder, name, ad = self._experts[key]
            # 4-bit experts merge into their dequantised weights (in the model's dtype, as for a 4-bit linear).
            return _merged_experts(expert_weight(getattr(holder, name), self._dtype), ad.lora_a[...], ad.lora_b[...],
                                   ad.lora_scale[...])
        lin = self._lins[key]
        # A 4-bit linear merges into its dequantised weight (in the model's dtype, as bitsandbytes computes it).
        kernel, a, b, scale = lin.frozen_kernel(self._dtype), lin.lora_a[...], lin.lora_b[...], lin.lora_scale[...]
        if a.ndim == 2:  # a linear outside any stack (the vision merger): one "layer"
            return _merged(kernel[None], a[None], b[None], scale[None])[0]
        return _merged(kernel, a, b, scale)

    def __iter__(self):
        return iter([*self._lins, *self._experts])

    def __len__(self):
        return len(self._lins) + len(self._experts)


def merged_kernels(model) -> Mapping[tuple[str, ...], jax.Array]:
    """{("layers", "attn", "q_proj", "kernel"): W + s*A@B (per layer, kernel dtype)} for every Linear with LoRA,
    and {("layers", "mlp", "gate_up_proj"): W_e + s*A_e@B_e (per layer and expert)} for every adapted expert kernel.

    The model is not modified (what `save_pretrained` exports). Values are computed on access.
    """
    return _MergedKernels(model)


def merge_lora(model):
    """Folds every adapter into its kernel (W <- W + s*A@B) and removes the adapters; in place, returns model."""
    merged = merged_kernels(model)
    experts = _expert_merges(model)
    for key, (holder, name, *_) in experts.items():
        if isinstance(getattr(holder, name), Quant4bitExperts):
            raise ValueError(f"merge_lora: {'.'.join(key)} holds 4-bit experts; merging would need re-quantising "
                             "them. Export the merged model with jaxft.save_pretrained (dequantised), or keep the "
                             "adapter separate (save_adapter)")
    for key in merged:
        if key not in experts and _linear(model, key[:-1]).quant is not None:
            raise ValueError(f"merge_lora: {'.'.join(key[:-1])} is a 4-bit linear; merging would need re-quantising "
                             "it. Export the merged model with jaxft.save_pretrained (dequantised), or keep the "
                             "adapter separate (save_adapter)")
    values = {key: merged[key] for key in experts}  # every expert kernel before any adapter is removed
    for key in list(merged):
        if key in experts:
            holder, name = experts[key][:2]
            getattr(holder, name)[...] = values[key]
            continue
        lin = _linear(model, key[:-1])
        lin.kernel[...] = merged[key]
        lin.lora_a = lin.lora_b = lin.lora_scale = lin.lora_rank = nnx.static(None)
        lin.lora_dropout = 0.0
    for path, _ in expert_adapters(model):
        *owner, slot = path.split(".")
        setattr(_linear(model, tuple(owner)), slot, None)
    model.lora_config = None
    return model


def lora_state(model) -> nnx.State:
    """The trainable adapter matrices (`LoraParam` variables) of `model`."""
    return nnx.state(model, LoraParam)


# --------------------------------------------------------------------------- PEFT adapter files


def _condensed_targets(model, plan) -> list[str]:
    """Explicit target names for an adapter file: a module's shortest unique suffix when all its layers are
    targeted (in every layer stack), else each targeted full name. Exact for every module name of the model."""
    mods = _modules(model)
    everything = [n for n, _, _ in mods.linear_names()] + list(mods.unsupported)
    by_template: dict[str, list[_Site]] = {}
    for site in mods.sites:
        by_template.setdefault(site.template, []).append(site)
    out = []
    for template, sites in by_template.items():
        targeted = [(n, p) for site in sites for n, p in zip(site.names(), plan.get(site) or [None] * len(site.names()))]
        if not any(p for _, p in targeted):
            continue
        names = {n for n, _ in targeted}
        if all(p for _, p in targeted):
            parts = template.split(".")
            for k in range(1, len(parts) + 1):
                suffix = ".".join(parts[-k:])
                if "{" not in suffix and {n for n in everything if peft_io.target_matches(n, (suffix,))} == names:
                    out.append(suffix)
                    break
            else:
                out.extend(n for n, _ in targeted)
        else:
            out.extend(n for n, p in targeted if p)
    return out


def save_adapter(model, path: str | os.PathLike, *, base_model_name_or_path: str | None = None,
                 overwrite: bool = False) -> Path:
    """Writes the model's adapters as a PEFT LoRA adapter directory (adapter_config.json +
    adapter_model.safetensors) that `peft.PeftModel.from_pretrained(hf_model, path)` loads without warnings.

    "all-linear" targets are written as the resolved explicit list (what PEFT itself stores).
    """
    cfg: LoraConfig | None = getattr(model, "lora_config", None)
    if cfg is None:
        raise ValueError("the model has no LoRA adapters to save; call apply_lora(model, LoraConfig(...)) or "
                         "load_adapter(model, dir) first")
    plan = _plan(model, cfg, strict=False)
    mods = _modules(model)
    dense_mlp = [n for site in mods.sites if site.path[:2] == ("dense_layers", "mlp") and plan.get(site)
                 for n, p in zip(site.names(), plan[site]) if p]
    if dense_mlp:
        # PEFT (0.21 with transformers 5) reads gate_proj / up_proj / down_proj targets of a Qwen3-MoE model as
        # the fused experts (its v4 -> v5 conversion), so these adapters would load onto the wrong weights.
        raise ValueError(f"save_adapter: LoRA on the dense layers' MLP ({dense_mlp[0]}, ...) of this "
                         f"{model.config.model_type} model has no PEFT form (PEFT reads gate_proj/up_proj/down_proj "
                         "targets there as the experts); export merged weights with jaxft.save_pretrained, or leave "
                         "them out of target_modules")
    weights = {}
    for site in mods.sites:
        if site not in plan:
            continue
        lin = _linear(model, site.path)
        a, b = np.asarray(lin.lora_a[...], np.float32), np.asarray(lin.lora_b[...], np.float32)
        ranks = np.asarray(lin.lora_rank[...])
        if not site.stacked:  # one "layer"
            a, b, ranks = a[None], b[None], ranks.reshape(1)
        for layer, name in enumerate(site.names()):
            if plan[site][layer] is None:
                continue
            r = int(ranks[layer])
            weights[name] = (a[layer, :, :r].T, b[layer, :r, :].T)
    keys = _param_keys(model, plan)
    for key, (name, site, layer, _) in keys.items():
        adapter = _linear(model, site.path)
        r = int(np.asarray(adapter.lora_rank[...])[layer])
        a = np.asarray(adapter.lora_a[...][layer], np.float32)[..., :r]
        b = np.asarray(adapter.lora_b[...][layer], np.float32)[..., :r, :]
        weights[key] = peft_io.pack_experts(a, b)
    fields = cfg.peft_fields()
    if cfg.target_modules == ALL_LINEAR:
        fields.update(target_modules=_condensed_targets(model, plan), exclude_modules=None)
    config = peft_io.make_adapter_config(**fields, base_model_name_or_path=base_model_name_or_path)
    return peft_io.save_adapter(path, config, weights, overwrite=overwrite,
                                parameters={k: (v[0], v[3]) for k, v in keys.items()})


def _param_keys(model, plan) -> dict[str, tuple[str, _Site, int, int]]:
    """{adapter-file module key: (parameter name, site, layer, experts E)} for every targeted expert parameter."""
    targeted = [(n, s, l) for n, s, l in _modules(model).param_names() if plan.get(s) and plan[s][l]]
    keys = peft_io.param_wrapper_keys([n for n, _, _ in targeted])
    return {keys[n]: (n, s, l, _expert_shape(_linear(model, s.path[:-1]), s.path[-1])[0]) for n, s, l in targeted}


def load_adapter(model, path: str | os.PathLike):
    """Applies the PEFT LoRA adapter in directory `path` to `model` (in place, returned): the adapter's config
    decides the targets, ranks and scales exactly as PEFT would, and its weights fill A and B.

    Errors name the file and the module: unsupported PEFT features (DoRA, LoRA bias, modules_to_save,
    embedding LoRA, ...), targeted modules without weights, weights for modules the config does not target or
    this model lacks, and shape mismatches with the model.
    """
    path = Path(path)
    source = path / peft_io.ADAPTER_CONFIG_NAME
    planned = {}

    def expert_keys(peft_cfg):  # called by the reader once the file holds only LoRA pairs
        try:
            planned["cfg"] = cfg = LoraConfig.from_peft(peft_cfg)
            planned["plan"] = plan = _plan(model, cfg, strict=False)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        planned["keys"] = keys = _param_keys(model, plan)
        return {k: (v[0], v[3]) for k, v in keys.items()}

    _, weights = peft_io.load_adapter(path, parameters=expert_keys)
    cfg, plan, keys = planned["cfg"], planned["plan"], planned["keys"]
    mods = _modules(model)
    key_of = {(site, layer): key for key, (_, site, layer, _) in keys.items()}
    targeted = {n for n, site, layer in mods.linear_names() if plan.get(site) and plan[site][layer]} | set(keys)
    missing, extra = sorted(targeted - set(weights)), sorted(set(weights) - targeted)
    weights_file = path / peft_io.ADAPTER_WEIGHTS_NAME
    if missing:
        raise ValueError(f"{weights_file}: no LoRA weights for {len(missing)} module(s) that {source.name} targets, "
                         f"e.g. {missing[:3]}; the adapter does not match its config (re-export it)")
    if extra:
        raise ValueError(f"{weights_file}: LoRA weights for {len(extra)} module(s) this {model.config.model_type} "
                         f"model does not have or {source.name} does not target, e.g. {extra[:3]}; was the "
                         "adapter trained for a different base model?")

    def fill(index: int, site: _Site, shape: tuple[int, ...], ranks: np.ndarray):
        *lead, n_in, n_out = shape  # lead: (E,) for an expert parameter
        r_max = int(ranks.max())
        a = np.zeros((len(ranks), *lead, n_in, r_max), np.float32)
        b = np.zeros((len(ranks), *lead, r_max, n_out), np.float32)
        for layer, name in enumerate(site.names()):
            r = int(ranks[layer])
            if not r:
                continue
            key = key_of.get((site, layer), name)
            pa, pb = weights[key]
            packed = r * (lead[0] if lead else 1)  # PEFT stacks the experts' ranks: r*E rows of A
            want = ((packed, n_in), (n_out, packed))
            if (pa.shape, pb.shape) != want:
                raise ValueError(
                    f"{weights_file}: {key}: lora_A {list(pa.shape)} / lora_B {list(pb.shape)} do not fit this "
                    f"model's {name} (expected {list(want[0])} / {list(want[1])}); was the adapter trained for a "
                    "different base model?")
            pa, pb = np.asarray(pa, np.float32), np.asarray(pb, np.float32)
            if lead:
                a[layer, ..., :r], b[layer, ..., :r, :] = peft_io.unpack_experts(pa, pb, lead[0])
            else:
                a[layer, :, :r], b[layer, :r, :] = pa.T, pb.T
        return jnp.asarray(a), jnp.asarray(b)

    _install(model, cfg, plan, fill)
    return model
