"""PEFT LoRA adapter directories <-> plain dicts of numpy arrays (never imports jaxft).

An adapter directory, as PEFT (0.17 .. 0.21) writes it for a causal LM::

    adapter_config.json         {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, ...}
    adapter_model.safetensors   metadata {"format": "pt"};
                                base_model.model.<module>.lora_A.weight  [r, in]
                                base_model.model.<module>.lora_B.weight  [out, r]

``<module>`` is the dotted module name inside the transformers model (``model.layers.3.self_attn.q_proj``).
A module's output becomes ``W x + s * B (A x)`` with ``s = alpha / r`` (``alpha / sqrt(r)`` under rsLoRA), where
``r`` and ``alpha`` may be overridden per module by ``rank_pattern`` / ``alpha_pattern``.

Raw parameters (``target_parameters``, PEFT >= 0.17: MoE experts stored as one [E, ., .] tensor) are adapted by
PEFT's ``ParamWrapper``: for a parameter of E experts with math shape [in] -> [out] per expert,

    lora_A.weight [r*E, in]   = reshape of A [E, r, in]   (expert index SLOWEST: rows e*r .. e*r+r-1)
    lora_B.weight [out, r*E]  = reshape of B [out, r, E]  (expert index FASTEST: column j*E + e)
    delta W_e = s * B[:, :, e] @ A[e]      ([out, in]; PEFT's ``get_delta_weight``)

Several targeted parameters of one module nest one wrapper per parameter, in the module's parameter order,
so their weights are stored under ``<module>.base_layer.`` repeated (see ``param_wrapper_keys``); ranks and
patterns are those of the full parameter name (``model.layers.3.mlp.experts.down_proj``).

The PEFT matching rules live here as pure string functions, so that the jaxft side and the file format agree
on one definition:

* ``target_matches``: a list entry matches a module when it equals the full name or is a suffix of it on a
  ``.`` boundary; a string is a regex that must ``re.fullmatch`` the full name.
* ``is_excluded``: same rules for ``exclude_modules``.
* ``pattern_key``: the first key ``k`` of a rank/alpha pattern dict (in dict order) for which
  ``re.match(rf"(.*\\.)?({k})$", name)`` succeeds.

Modules trained in full (``modules_to_save``) are stored whole under their module's name, and trainable token
rows (``trainable_token_indices``, PEFT >= 0.15) as the replaced rows, in the order of the config's ids::

    base_model.model.<module>.weight                                        [V, H] (torch layout: lm_head too)
    base_model.model.<module>.token_adapter.trainable_tokens_delta          [n, H] (values, not differences)

Where the vocabulary was resized (new tokens), PEFT also stores the resized base tables, under
``<module>.original_module.weight``, ``<module>.token_adapter.base_layer.weight`` or, for a module it does not
wrap, ``<module>.weight`` (and ``<module>.modules_to_save.weight``, a second copy of the trained table).

Only what jaxft can represent is accepted: LoRA on linear layers, plus those. DoRA, LoRA biases,
embedding LoRA, layer selection and base-modifying initialisations (PiSSA, OLoRA, CorDA,
LoftQ) are refused with a message that says so, rather than loaded wrongly.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bridge.errors import CheckpointError, hub_id_hint, python_command
from bridge.safetensors_io import PendingTensor, new_temp_dir, read_header, read_into, write_file

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "ALL_LINEAR",
    "KEY_PREFIX",
    "AdapterError",
    "check_adapter_config",
    "is_excluded",
    "load_adapter",
    "load_trained",
    "make_adapter_config",
    "module_rank_alpha",
    "pack_experts",
    "param_wrapper_keys",
    "pattern_key",
    "read_adapter_config",
    "save_adapter",
    "target_matches",
    "unpack_experts",
]

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
ALL_LINEAR = "all-linear"
_SUFFIX_A, _SUFFIX_B = ".lora_A.weight", ".lora_B.weight"
SAVED_SUFFIX = ".weight"  # a module of modules_to_save
TOKENS_SUFFIX = ".token_adapter.trainable_tokens_delta"
_PICKLED = ("adapter_model.bin", "adapter_model.pt")
# A PEFT pickle is a plain state dict under the same keys as the safetensors file, so torch.load with
# weights_only=True (tensors only, no arbitrary objects) reads it and save_file writes it unchanged.
_CONVERT_CODE = (
    "import torch; from safetensors.torch import save_file; "
    "state = torch.load({SRC}, map_location=\"cpu\", weights_only=True); "
    "save_file({k: v.contiguous() for k, v in state.items()}, {OUT}, metadata={\"format\": \"pt\"})"
)


class AdapterError(CheckpointError):
    """An adapter directory or adapter config is malformed or uses a PEFT feature jaxft does not support."""


# --------------------------------------------------------------------------- PEFT matching rules


def target_matches(name: str, target_modules: str | Sequence[str]) -> bool:
    """Whether module ``name`` (full dotted HF name) is selected by ``target_modules`` (PEFT semantics)."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith("." + t) for t in target_modules)


def is_excluded(name: str, exclude_modules: str | Sequence[str] | None) -> bool:
    """Whether ``exclude_modules`` removes ``name`` from the targets (same rules as ``target_matches``)."""
    if not exclude_modules:
        return False
    return target_matches(name, exclude_modules)


def pattern_key(patterns: Mapping[str, Any], name: str) -> str | None:
    """The first key of ``patterns`` (dict order) that matches ``name`` as ``(.*\\.)?(key)$``; None if none does."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return None


def module_rank_alpha(config: Mapping[str, Any], name: str) -> tuple[int, float]:
    """(rank, alpha) of module ``name`` under a PEFT config dict (``r``/``lora_alpha`` unless a pattern matches)."""
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    rk, ak = pattern_key(rank_pattern, name), pattern_key(alpha_pattern, name)
    rank = rank_pattern[rk] if rk is not None else config["r"]
    alpha = alpha_pattern[ak] if ak is not None else config["lora_alpha"]
    return int(rank), alpha


def param_wrapper_keys(targeted: Sequence[str]) -> dict[str, str]:
    """{full parameter name: the module key its LoRA weights are stored under} for the targeted raw parameters,
    listed in each module's parameter order (``model.layers.0.mlp.experts.gate_up_proj``, ``..down_proj``).

    PEFT wraps the module once per targeted parameter in that order, each wrapper around the previous one, and
    a wrapper's weights sit at its place in the module tree: the last parameter's under ``<module>``, the one
    before under ``<module>.base_layer``, and so on."""
    by_module: dict[str, list[str]] = {}
    for name in targeted:
        by_module.setdefault(name.rpartition(".")[0], []).append(name)
    out = {}
    for module, names in by_module.items():
        for k, name in enumerate(names):
            out[name] = module + ".base_layer" * (len(names) - 1 - k)
    return out


def pack_experts(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-expert factors A [E, in, r], B [E, r, out] (W_e + A_e B_e in [in, out] form) -> PEFT's ParamWrapper
    (lora_A [r*E, in] with the expert index slowest, lora_B [out, r*E] with the expert index fastest)."""
    e, n_in, r = a.shape
    return (np.ascontiguousarray(a.transpose(0, 2, 1).reshape(e * r, n_in)),
            np.ascontiguousarray(b.transpose(2, 1, 0).reshape(b.shape[2], r * e)))


def unpack_experts(lora_a: np.ndarray, lora_b: np.ndarray, experts: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of ``pack_experts``: PEFT's lora_A [r*E, in], lora_B [out, r*E] -> A [E, in, r], B [E, r, out]
    (PEFT's own reshapes: ``A.reshape(E, r, in)`` and ``B.reshape(out, r, E)``)."""
    r = lora_a.shape[0] // experts
    return (lora_a.reshape(experts, r, lora_a.shape[1]).transpose(0, 2, 1),
            lora_b.reshape(lora_b.shape[0], r, experts).transpose(2, 1, 0))


# --------------------------------------------------------------------------- config

# Keys that must be absent/false/empty: each is a PEFT feature that changes the forward pass or the base weights
# in a way jaxft does not implement. Value: what to tell the user.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora=true) is not supported; train/export plain LoRA, or merge the DoRA adapter "
                "into the base model with PEFT (merge_and_unload) and fine-tune that",
    "lora_bias": "LoRA biases (lora_bias=true) are not supported",
    "layers_to_transform": "layers_to_transform is not supported; select layers with full module names or a "
                           "regex in target_modules instead",
    "layers_pattern": "layers_pattern is not supported; select layers with a regex in target_modules instead",
    "layer_replication": "layer_replication is not supported",
    "fan_in_fan_out": "fan_in_fan_out=true (GPT-2 Conv1D layout) is not supported",
    "use_qalora": "QA-LoRA (use_qalora=true) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
}
# init_lora_weights values whose adapters only make sense on a base model PEFT modified in place.
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "loftq")

# The keys we write: PEFT's LoraConfig fields that have existed since PEFT 0.14, so that any PEFT the project
# supports (pyproject: peft>=0.17) loads the file without "unexpected keyword" warnings; PEFT fills the rest
# with its defaults.
_DEFAULTS: dict[str, Any] = {
    "alpha_pattern": {},
    "auto_mapping": None,
    "base_model_name_or_path": None,
    "bias": "none",
    "exclude_modules": None,
    "fan_in_fan_out": False,
    "inference_mode": True,
    "init_lora_weights": True,
    "layer_replication": None,
    "layers_pattern": None,
    "layers_to_transform": None,
    "loftq_config": {},
    "lora_alpha": 8,
    "lora_bias": False,
    "lora_dropout": 0.0,
    "megatron_config": None,
    "megatron_core": "megatron.core",
    "modules_to_save": None,
    "peft_type": "LORA",
    "r": 8,
    "rank_pattern": {},
    "revision": None,
    "target_modules": None,
    "task_type": "CAUSAL_LM",
    "use_dora": False,
    "use_rslora": False,
}


def make_adapter_config(*, r: int, lora_alpha: float, target_modules: str | Sequence[str] | None,
                        lora_dropout: float = 0.0, use_rslora: bool = False,
                        rank_pattern: Mapping[str, int] | None = None,
                        alpha_pattern: Mapping[str, float] | None = None,
                        exclude_modules: str | Sequence[str] | None = None,
                        target_parameters: Sequence[str] | None = None,
                        modules_to_save: Sequence[str] | None = None,
                        trainable_token_indices: Sequence[int] | Mapping[str, Sequence[int]] | None = None,
                        ensure_weight_tying: bool = False,
                        base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """A complete ``adapter_config.json`` dict for a CAUSAL_LM LoRA adapter (validated).

    ``target_modules``: a regex string is written as is; a list is written sorted (PEFT keeps a set). Pass
    "all-linear" resolved to explicit names: the file then means the same thing whatever the loader's rules.
    None (only with ``target_parameters``) is written as [] (PEFT's way of saying "no modules").
    ``target_parameters``, ``trainable_token_indices`` and ``ensure_weight_tying`` are written as given, and only
    when set (older PEFTs do not know the keys).
    """
    cfg = dict(_DEFAULTS)
    if target_parameters:
        cfg["target_parameters"] = list(target_parameters)
    if trainable_token_indices:
        cfg["trainable_token_indices"] = (
            {k: list(v) for k, v in trainable_token_indices.items()} if isinstance(trainable_token_indices, Mapping)
            else list(trainable_token_indices))
    if ensure_weight_tying:
        cfg["ensure_weight_tying"] = True
    if modules_to_save:
        cfg["modules_to_save"] = list(modules_to_save)
    cfg.update(
        r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, use_rslora=use_rslora,
        target_modules=(target_modules if isinstance(target_modules, str) else sorted(target_modules or ())),
        rank_pattern=dict(rank_pattern or {}), alpha_pattern=dict(alpha_pattern or {}),
        exclude_modules=(exclude_modules if exclude_modules is None or isinstance(exclude_modules, str)
                         else sorted(exclude_modules)),
        base_model_name_or_path=base_model_name_or_path,
    )
    return check_adapter_config(cfg, "make_adapter_config")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_adapter_config(config: Mapping[str, Any], source: str | os.PathLike) -> dict[str, Any]:
    """Validate a PEFT adapter config dict; returns a copy. ``source`` (a file name) prefixes every error.

    Refuses, with the reason, any PEFT feature jaxft cannot reproduce exactly (see ``_UNSUPPORTED``).
    """
    if not isinstance(config, Mapping):
        raise AdapterError(f"{source}: an adapter config must be a JSON object, got {type(config).__name__}")
    cfg = dict(config)

    def bad(key: str, why: str):
        raise AdapterError(f"{source}: {key}={cfg.get(key)!r}: {why}")

    peft_type = cfg.get("peft_type")
    if str(peft_type).upper() != "LORA":
        bad("peft_type", "only LoRA adapters (peft_type 'LORA') are supported")
    cfg["peft_type"] = "LORA"
    if cfg.get("task_type") not in (None, "CAUSAL_LM"):
        bad("task_type", "only causal-LM adapters (task_type 'CAUSAL_LM') are supported")
    for key, why in _UNSUPPORTED.items():
        value = cfg.get(key)
        if value not in (None, False, [], {}, ""):
            bad(key, why)
    if cfg.get("bias", "none") != "none":
        bad("bias", "training base-layer biases is not supported; only bias='none' adapters can be loaded")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        bad("init_lora_weights", "this initialisation modifies the base weights, so the adapter does not apply "
            "to the original base model; convert it first with PEFT's save_pretrained("
            "path_initial_model_for_weight_conversion=...)")
    for key in ("r",):
        if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool) or cfg[key] <= 0:
            bad(key, "must be a positive integer")
    if not _is_number(cfg.get("lora_alpha")):
        bad("lora_alpha", "must be a finite number")
    dropout = cfg.get("lora_dropout", 0.0)
    if not _is_number(dropout) or not 0.0 <= dropout < 1.0:
        bad("lora_dropout", "must be a number in [0, 1)")
    if not isinstance(cfg.get("use_rslora", False), bool):
        bad("use_rslora", "must be true or false")
    if not isinstance(cfg.get("ensure_weight_tying", False), bool):
        bad("ensure_weight_tying", "must be true or false")
    saved = cfg.get("modules_to_save")
    if saved is not None and not (isinstance(saved, (list, tuple)) and all(isinstance(t, str) and t for t in saved)):
        bad("modules_to_save", "must be null or a list of module names (e.g. ['embed_tokens', 'lm_head'])")
    tokens = cfg.get("trainable_token_indices")
    names, lists = (list(tokens), list(tokens.values())) if isinstance(tokens, Mapping) else ([], [tokens])
    if tokens is not None and not (all(isinstance(k, str) and k for k in names) and all(map(_is_id_list, lists))):
        bad("trainable_token_indices", "must be null, a list of token ids or {module name: list of token ids}")

    params = cfg.get("target_parameters")
    if params is not None and not (isinstance(params, (list, tuple)) and all(isinstance(t, str) and t for t in params)):
        bad("target_parameters", "must be null or a list of parameter names (e.g. ['mlp.experts.gate_up_proj'])")
    if params and dropout:
        bad("lora_dropout", "must be 0 with target_parameters (PEFT's ParamWrapper cannot apply dropout to a "
            "raw parameter)")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        _check_regex(targets, "target_modules", source)
    elif isinstance(targets, (list, tuple, set)) and targets and all(isinstance(t, str) and t for t in targets):
        cfg["target_modules"] = sorted(targets)
    elif params and not targets:
        cfg["target_modules"] = []  # only parameters are adapted
    else:
        bad("target_modules", "must be a regex string or a non-empty list of module names (e.g. "
            "['q_proj', 'v_proj'])")
    excludes = cfg.get("exclude_modules")
    if isinstance(excludes, str):
        _check_regex(excludes, "exclude_modules", source)
    elif excludes is not None and not (isinstance(excludes, (list, tuple, set))
                                       and all(isinstance(t, str) and t for t in excludes)):
        bad("exclude_modules", "must be null, a regex string or a list of module names")

    for key, check, what in (("rank_pattern", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
                              "a positive integer rank"),
                             ("alpha_pattern", _is_number, "a finite number")):
        pattern = cfg.get(key) or {}
        if not isinstance(pattern, Mapping):
            bad(key, "must be an object mapping module-name patterns to values")
        for k, v in pattern.items():
            _check_regex(k, f"{key} key", source)
            if not check(v):
                raise AdapterError(f"{source}: {key}[{k!r}]={v!r}: must be {what}")
        cfg[key] = dict(pattern)
    return cfg


def _is_id_list(value) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                    for i in value)


def _check_regex(pattern: str, what: str, source) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise AdapterError(f"{source}: {what} {pattern!r} is not a valid regular expression ({e})") from None


# --------------------------------------------------------------------------- files


def save_adapter(path: str | os.PathLike, config: Mapping[str, Any],
                 weights: Mapping[str, tuple[np.ndarray, np.ndarray]], *, overwrite: bool = False,
                 parameters: Mapping[str, tuple[str, int]] | None = None,
                 saved: Mapping[str, np.ndarray] | None = None,
                 token_rows: Mapping[str, np.ndarray] | None = None) -> Path:
    """Write a PEFT adapter directory.

    Args:
      path: target directory. Written atomically: both files go to a temp dir next to it, which is renamed onto
        ``path`` at the end (an existing non-empty ``path`` needs ``overwrite=True``).
      config: adapter config dict (see ``make_adapter_config``); validated, then written with sorted keys.
      weights: ``{module name: (A [r, in], B [out, r])}`` in PEFT's (torch) layout, ``module name`` being the
        HF dotted name (``model.layers.0.self_attn.q_proj``). Each module's rank must be the one the config
        assigns it (``r`` or its ``rank_pattern`` entry).
      parameters: ``{module key: (parameter name, experts E)}`` for the keys of ``weights`` that adapt raw
        parameters (see ``param_wrapper_keys``): their A is [r*E, in], B [out, r*E], r that of the parameter name.
      saved: ``{module name: weight}`` of the modules trained in full (``modules_to_save``), torch layout.
      token_rows: ``{module name: rows [n, H]}`` of the trainable tokens (in the order of the config's ids).
    """
    target = Path(path)
    cfg = check_adapter_config(config, f"adapter config for {target}")
    tensors: list[PendingTensor] = []
    for name in sorted(weights):
        a, b = (np.asarray(x) for x in weights[name])
        rank = _packed_rank(cfg, name, parameters)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(
                f"adapter weights for {name!r}: A {list(a.shape)} / B {list(b.shape)} must be [r, in] / [out, r] "
                f"with r={rank} (the rank adapter_config assigns to this module, times its experts)")
        for suffix, arr in ((_SUFFIX_A, a), (_SUFFIX_B, b)):
            arr = np.ascontiguousarray(arr)
            tensors.append(PendingTensor(KEY_PREFIX + name + suffix, arr.shape, arr.dtype,
                                         lambda arr=arr: arr))
    for suffix, extra in ((SAVED_SUFFIX, saved or {}), (TOKENS_SUFFIX, token_rows or {})):
        for name in sorted(extra):
            arr = np.ascontiguousarray(extra[name])
            tensors.append(PendingTensor(KEY_PREFIX + name + suffix, arr.shape, arr.dtype, lambda arr=arr: arr))
    if not tensors:
        raise AdapterError(f"refusing to write {target}: the adapter has no LoRA weights")
    if target.exists() and not target.is_dir():
        raise AdapterError(f"adapter target {target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise AdapterError(f"adapter target {target} exists and is not empty; pass overwrite=True to replace it")

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_temp_dir(target)
    try:
        write_file(tmp / ADAPTER_WEIGHTS_NAME, tensors, {"format": "pt"})
        (tmp / ADAPTER_CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if target.exists():
            # Move the old directory aside first: `target` is missing only between the two renames, and a reader
            # never sees a mix of old and new files.
            old = new_temp_dir(target, "old")
            os.rename(target, old / "prev")
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _packed_rank(cfg: Mapping[str, Any], key: str, parameters: Mapping[str, tuple[str, int]] | None) -> int:
    """The leading/trailing size of a stored A/B pair: r of a module, r*E of a raw expert parameter."""
    if parameters and key in parameters:
        name, experts = parameters[key]
        return module_rank_alpha(cfg, name)[0] * int(experts)
    return module_rank_alpha(cfg, key)[0]


def read_adapter_config(path: str | os.PathLike) -> dict[str, Any]:
    """The validated ``adapter_config.json`` of adapter directory ``path`` (errors name the file)."""
    root = Path(path)
    cfg_file = root / ADAPTER_CONFIG_NAME
    if not root.is_dir():
        hint = hub_id_hint(root) or f"; pass the folder holding {ADAPTER_CONFIG_NAME}"
        raise AdapterError(f"adapter path {root} is not a directory{hint}")
    if not cfg_file.is_file():
        raise AdapterError(f"{root} has no {ADAPTER_CONFIG_NAME}; is this a PEFT adapter directory?")
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{cfg_file}: cannot read adapter config ({e})") from None
    return check_adapter_config(raw, cfg_file)


def load_adapter(path: str | os.PathLike, *,
                 parameters: Callable[[dict[str, Any]], Mapping[str, tuple[str, int]]] | None = None
                 ) -> tuple[dict[str, Any], dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Read a PEFT LoRA adapter directory -> (validated config dict, {module name: (A [r, in], B [out, r])}).

    Arrays keep their stored dtype (bfloat16 comes back as ``ml_dtypes.bfloat16``). Every module must have both
    matrices, with the rank the config assigns it; any other tensor is an error naming it. ``parameters``:
    called with the validated config once the file holds only LoRA pairs, it returns (as for ``save_adapter``)
    the keys that hold raw-parameter (expert) adapters, whose sizes are r*E.
    """
    root = Path(path)
    cfg_file, weights_file = root / ADAPTER_CONFIG_NAME, root / ADAPTER_WEIGHTS_NAME
    cfg = read_adapter_config(root)
    if not weights_file.is_file():
        pickled = [p for p in _PICKLED if (root / p).is_file()]
        hint = ""
        if pickled:
            command = python_command(_CONVERT_CODE, SRC=root / pickled[0], OUT=weights_file)
            hint = (f" (found {pickled[0]}: a pickle, refused because unpickling can run code); convert it "
                    f"once with `{command}` (it writes {ADAPTER_WEIGHTS_NAME} beside it), then load {root}")
        raise AdapterError(f"{root} has no {ADAPTER_WEIGHTS_NAME}{hint}")

    infos, _ = read_header(weights_file)
    pairs: dict[str, dict[str, Any]] = {}
    foreign: list[str] = []
    for key, info in infos.items():
        if _trained_key(cfg, key):
            continue  # read by load_trained
        suffix = _SUFFIX_A if key.endswith(_SUFFIX_A) else _SUFFIX_B if key.endswith(_SUFFIX_B) else None
        if not key.startswith(KEY_PREFIX) or suffix is None:
            foreign.append(key)
            continue
        pairs.setdefault(key[len(KEY_PREFIX):-len(suffix)], {})[suffix] = info
    if foreign:
        raise AdapterError(f"{weights_file}: tensors that are not plain LoRA A/B matrices: {_listing(foreign)}\n"
                           f"{_why_foreign(foreign)}")
    wrapped = parameters(cfg) if parameters is not None else None

    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    fd = os.open(weights_file, os.O_RDONLY)
    try:
        bounce = np.empty(1 << 20, np.uint8)
        for name in sorted(pairs):
            half = pairs[name]
            for suffix in (_SUFFIX_A, _SUFFIX_B):
                if suffix not in half:
                    raise AdapterError(f"{weights_file}: {KEY_PREFIX}{name}{suffix} is missing (its partner "
                                       "matrix is present); the file is incomplete: re-export the adapter")
            a_info, b_info = half[_SUFFIX_A], half[_SUFFIX_B]
            rank = _packed_rank(cfg, name, wrapped)
            for info, ok in ((a_info, len(a_info.shape) == 2 and a_info.shape[0] == rank),
                             (b_info, len(b_info.shape) == 2 and b_info.shape[1] == rank)):
                if not ok:
                    raise AdapterError(
                        f"{weights_file}: {info.name} has shape {list(info.shape)}, but {cfg_file.name} gives "
                        f"module {name!r} rank {rank} (A must be [{rank}, in], B [out, {rank}]); r/rank_pattern "
                        "and the weights disagree")
                if info.dtype is None or info.dtype.kind != "f" and info.code != "BF16":
                    raise AdapterError(f"{weights_file}: {info.name} has dtype {info.code}; LoRA weights must be "
                                       "floating point (F32, F16 or BF16)")
            arrays = []
            for info in (a_info, b_info):
                dst = np.empty(info.shape, info.dtype)
                read_into(fd, weights_file, info, dst, None, bounce)
                arrays.append(dst)
            out[name] = (arrays[0], arrays[1])
    finally:
        os.close(fd)
    if not out:
        raise AdapterError(f"{weights_file}: holds no LoRA weights")
    return cfg, out


_BASE_SUFFIXES = (".original_module.weight", ".token_adapter.base_layer.weight")
_COPY_SUFFIX = ".modules_to_save.weight"


def _trained_key(cfg: Mapping[str, Any], key: str) -> tuple[str, str] | None:
    """(module name, kind) of a tensor key that is not a LoRA matrix, under a config with modules_to_save or
    trainable tokens: kind "saved" (a module trained in full), "rows" (trainable-token rows), "base" (a resized
    base table) or "copy" (PEFT's second copy of a saved module); None for any other key."""
    if not key.startswith(KEY_PREFIX) or key.endswith((_SUFFIX_A, _SUFFIX_B)):
        return None
    saved, tokens = cfg.get("modules_to_save") or (), cfg.get("trainable_token_indices")
    if not (saved or tokens):
        return None
    name = key[len(KEY_PREFIX):]
    if tokens and name.endswith(TOKENS_SUFFIX):
        return name[: -len(TOKENS_SUFFIX)], "rows"
    for suffix, kind in [(s, "base") for s in _BASE_SUFFIXES] + [(_COPY_SUFFIX, "copy")]:
        if name.endswith(suffix):
            return name[: -len(suffix)], kind
    if name.endswith(SAVED_SUFFIX):
        module = name[: -len(SAVED_SUFFIX)]
        return module, "saved" if target_matches(module, saved) else "base"
    return None


def load_trained(path: str | os.PathLike) -> dict[str, dict[str, np.ndarray]]:
    """The tensors of adapter directory ``path`` beside its LoRA matrices, by kind (see ``_trained_key``):
    {"saved": {module name: weight (torch layout)}, "rows": {module name: rows [n, H]}, "base": {module name:
    resized base weight}}, empty where the config has neither modules_to_save nor trainable tokens."""
    root = Path(path)
    cfg, weights_file = read_adapter_config(root), root / ADAPTER_WEIGHTS_NAME
    out: dict[str, dict[str, np.ndarray]] = {"saved": {}, "rows": {}, "base": {}}
    if not (cfg.get("modules_to_save") or cfg.get("trainable_token_indices")) or not weights_file.is_file():
        return out
    infos, _ = read_header(weights_file)
    fd = os.open(weights_file, os.O_RDONLY)
    try:
        bounce = np.empty(1 << 20, np.uint8)
        for key, info in infos.items():
            hit = _trained_key(cfg, key)
            if hit is None or hit[1] == "copy":
                continue
            if info.dtype is None or info.dtype.kind != "f" and info.code != "BF16" or len(info.shape) != 2:
                raise AdapterError(f"{weights_file}: {key} has dtype {info.code} and shape {list(info.shape)}; "
                                   "trained weights must be a floating-point matrix")
            dst = np.empty(info.shape, info.dtype)
            read_into(fd, weights_file, info, dst, None, bounce)
            out[hit[1]][hit[0]] = dst
    finally:
        os.close(fd)
    return out


def _listing(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(sorted(items)[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def _why_foreign(keys: list[str]) -> str:
    text = " ".join(keys)
    if "lora_magnitude_vector" in text:
        return "these are DoRA magnitudes: DoRA adapters are not supported"
    if "lora_embedding_" in text:
        return "these are embedding LoRA matrices: LoRA on embeddings is not supported"
    if ".lora_B.bias" in text:
        return "these are LoRA biases (lora_bias=true): not supported"
    if ".base_layer." in text:
        return ("these are full base-layer weights, which PEFT saves when it adapts the output head (lm_head) or "
                "the embeddings: LoRA on those layers is not supported")
    if "modules_to_save" in text or "trainable_tokens" in text:
        return "these are modules_to_save / trainable-token weights that adapter_config.json does not declare"
    return (f"expected only '{KEY_PREFIX}<module>{_SUFFIX_A}' and '{KEY_PREFIX}<module>{_SUFFIX_B}' keys "
            "(a LoRA adapter saved by PEFT for a causal LM)")
