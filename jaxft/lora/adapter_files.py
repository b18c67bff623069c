"""PEFT adapter files: `save_adapter` writes what `peft.PeftModel.from_pretrained` loads unchanged,
`load_adapter` reads PEFT's files (MoE experts in PEFT's packed `target_parameters` layout)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from bridge import peft as peft_io
from jaxft.errors import ConfigError
from jaxft.lora import trained
from jaxft.lora.apply import _expert_shape, _install, _linear
from jaxft.lora.config import ALL_LINEAR, LoraConfig
from jaxft.lora.targets import _modules, _plan, _Site

logger = logging.getLogger("jaxft.lora")


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

    "all-linear" targets are written as the resolved explicit list (what PEFT itself stores). Embeddings / head
    trained in full and trained token rows are written in PEFT's format (`bridge.peft`).
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
    saved, token_rows = trained.exported(model)
    return peft_io.save_adapter(path, config, weights, overwrite=overwrite,
                                parameters={k: (v[0], v[3]) for k, v in keys.items()}, saved=saved,
                                token_rows=token_rows)


def _param_keys(model, plan) -> dict[str, tuple[str, _Site, int, int]]:
    """{adapter-file module key: (parameter name, site, layer, experts E)} for every targeted expert parameter."""
    targeted = [(n, s, l) for n, s, l in _modules(model).param_names() if plan.get(s) and plan[s][l]]
    keys = peft_io.param_wrapper_keys([n for n, _, _ in targeted])
    return {keys[n]: (n, s, l, _expert_shape(_linear(model, s.path[:-1]), s.path[-1])[0]) for n, s, l in targeted}


def load_adapter(model, path: str | os.PathLike):
    """Applies the PEFT LoRA adapter in directory `path` to `model` (in place, returned): the adapter's config
    decides the targets, ranks and scales exactly as PEFT would, and its weights fill A and B.

    Errors (`bridge.peft.AdapterError`, a ValueError) name the file and the module: unsupported PEFT features
    (DoRA, LoRA bias, embedding LoRA, ...), targeted modules without weights, weights for modules
    the config does not target or this model lacks, and shape mismatches with the model. NaN or infinite weights
    are loaded with a warning naming the tensor.
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
        raise peft_io.AdapterError(f"{weights_file}: no LoRA weights for {len(missing)} module(s) that {source.name} "
                                   f"targets, e.g. {missing[:3]}; the adapter does not match its config (re-export it)")
    if extra:
        raise peft_io.AdapterError(f"{weights_file}: LoRA weights for {len(extra)} module(s) this "
                                   f"{model.config.model_type} model does not have or {source.name} does not target, "
                                   f"e.g. {extra[:3]}; was the adapter trained for a different base model?")

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
                raise peft_io.AdapterError(
                    f"{weights_file}: {key}: lora_A {list(pa.shape)} / lora_B {list(pb.shape)} do not fit this "
                    f"model's {name} (expected {list(want[0])} / {list(want[1])}); was the adapter trained for a "
                    "different base model?")
            pa, pb = np.asarray(pa, np.float32), np.asarray(pb, np.float32)
            for part, arr in (("lora_A", pa), ("lora_B", pb)):
                if not np.isfinite(arr).all():
                    logger.warning("%s: %s.%s holds %d NaN or infinite values: the adapter's outputs will be NaN",
                                   weights_file, key, part, int((~np.isfinite(arr)).sum()))
            if lead:
                a[layer, ..., :r], b[layer, ..., :r, :] = peft_io.unpack_experts(pa, pb, lead[0])
            else:
                a[layer, :, :r], b[layer, :r, :] = pa.T, pb.T
        return jnp.asarray(a), jnp.asarray(b)

    try:
        trained.check_names(model, cfg)
        stored = peft_io.load_trained(path)
        trained.adopt_base_tables(model, stored["base"], weights_file)  # new tokens: PEFT's resized tables
        trained.plan(model, cfg)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    values = trained.values_of(model, cfg, stored["saved"], stored["rows"], weights_file)
    _install(model, cfg, plan, fill)
    trained.install(model, cfg, values)
    return model
