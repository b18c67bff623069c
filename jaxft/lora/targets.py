"""Which linears and expert weights a `LoraConfig` targets, decided on Hugging Face module names with PEFT's
rules; the HF name <-> jaxft path correspondence comes from the family's bridge table."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from bridge import peft as peft_io
from bridge.mappings.schema import LAYER, VISION_BLOCK
from jaxft.errors import ConfigError
from jaxft.families import family_for
from jaxft.lora.config import ALL_LINEAR, LoraConfig, LoraConfigError
from jaxft.models.layers import linears
from jaxft.models.stack import layer_stacks


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


