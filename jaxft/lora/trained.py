"""Base matrices trained beside the adapters, with PEFT's semantics: whole modules (`modules_to_save`: the
embeddings and the output head, `SavedParam`) and single token rows (`trainable_token_indices`, `TokenRows`).

PEFT's rules reproduced here:
* modules_to_save trains a copy of each named module. With tied embeddings each named module gets its own
  copy (the embedding's and the head's diverge in training); the module not named keeps the original table.
  Only `ensure_weight_tying` with "embed_tokens" named keeps one table for both. jaxft unties such a model:
  the head becomes its own [H, V] kernel (a copy of the table), so each copy is a variable of its own.
* trainable tokens replace rows of the table (index_copy, not a delta added to it), starting from the rows'
  values; a tied head reads the same replaced table.

New tokens grow the tables first (`resize_embeddings`, transformers' `resize_token_embeddings` with its mean
initialisation); their rows are then trained like any other (`new_token_config`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bridge import peft as peft_io
from jaxft.errors import ConfigError
from jaxft.lora.config import LoraConfig, LoraConfigError
from jaxft.families import family_for
from jaxft.models.layers import Linear, SavedParam, TokenIds, TokenRows, TrainableParam, logical, with_token_rows

EMBED, HEAD = "embed", "head"
_PATHS = {EMBED: ("embed", "embedding"), HEAD: ("lm_head", "kernel")}


def module_names(model) -> dict[str, str]:
    """{EMBED: HF name of the embeddings ("model.embed_tokens"), HEAD: of the output head ("lm_head")}, from the
    family's bridge table (a tied model's head keeps its name: transformers and PEFT still have the module)."""
    out = {}
    for row in family_for(model.config.model_type).module_table:
        for role, path in _PATHS.items():
            if row.path == path:
                out[role] = row.hf[: -len(".weight")]
    return out


def _select(names: dict[str, str], entries, field: str, model_type: str) -> set[str]:
    """The roles that module-name entries select (PEFT's suffix rule); an entry that selects none is an error."""
    chosen = set()
    for entry in entries:
        hit = {role for role, name in names.items() if peft_io.target_matches(name, (entry,))}
        if not hit:
            raise LoraConfigError(field, f"{entry!r} names no module jaxft can train in full on this {model_type} "
                                         f"model; use {', '.join(repr(n.rsplit('.', 1)[-1]) for n in names.values())}")
        chosen |= hit
    return chosen


def check_names(model, cfg: LoraConfig) -> None:
    """Raises `LoraConfigError` where modules_to_save or a trainable_token_indices key names a module jaxft cannot
    train (anything but the embeddings and the output head)."""
    names, model_type = module_names(model), model.config.model_type
    _select(names, cfg.modules_to_save or (), "modules_to_save", model_type)
    _select(names, cfg.token_index_map, "trainable_token_indices", model_type)


def plan(model, cfg: LoraConfig) -> tuple[set[str], dict[str, tuple[int, ...]]]:
    """(roles trained in full, {role: token ids trained}) of `cfg` on `model`, checked."""
    names, model_type = module_names(model), model.config.model_type
    saved = _select(names, cfg.modules_to_save or (), "modules_to_save", model_type)
    rows: dict[str, tuple[int, ...]] = {}
    for entry, ids in cfg.token_index_map.items():
        for role in _select(names, (entry,), "trainable_token_indices", model_type):
            if rows.get(role, ids) != ids:
                raise LoraConfigError("trainable_token_indices", f"{entry!r} gives {names[role]} a second id list")
            rows[role] = ids
    tied = model.lm_head is None
    if tied and HEAD in rows:
        # PEFT trains the head's rows apart from the embedding's here (its rows then differ from the shared table's):
        # jaxft keeps one table, so only the tied form is accepted.
        if rows.get(EMBED) != rows[HEAD]:
            raise LoraConfigError("trainable_token_indices", f"{names[HEAD]} and {names[EMBED]} share one table in "
                                  "this model (tied embeddings): give them the same token ids, or name only "
                                  f"{names[EMBED]!r} (the head follows it)")
        rows[EMBED] = rows.pop(HEAD)
    both = saved & set(rows)
    if both:
        raise LoraConfigError("trainable_token_indices", f"{names[both.pop()]} is in modules_to_save as well: it is "
                              "trained in full already")
    vocab = model.config.vocab_size
    for role, ids in rows.items():
        if max(ids) >= vocab:
            raise LoraConfigError("trainable_token_indices", f"token id {max(ids)} is outside the vocabulary "
                                  f"({vocab} tokens); resize the embeddings first")
    return saved, rows


def install(model, cfg: LoraConfig, values: Mapping[str, np.ndarray] | None = None) -> None:
    """Makes the matrices and rows `cfg` names trainable (fp32 `SavedParam` / `TokenRows`), from `values`
    ({role: full table [V, H] (torch layout) or rows [n, H]}, an adapter's weights) or from the base."""
    saved, rows = plan(model, cfg)
    if not saved and not rows:
        return
    if any(isinstance(v, TrainableParam) for v in (_var(model, EMBED), _var(model, HEAD))) or any(
            getattr(m, "token_rows", None) is not None for m in (model.embed, model.lm_head) if m is not None):
        raise ValueError("the model already has trained embeddings or head; start from a freshly loaded base model")
    values = dict(values or {})
    if model.lm_head is None and saved and not (cfg.ensure_weight_tying and EMBED in saved):
        _untie(model)
    for role in saved:
        var = _var(model, role)
        if role == HEAD and var is None:
            raise ConfigError("modules_to_save: the output head is stored quantised (load_in_4bit / FP8); list "
                              "lm_head in llm_int8_skip_modules to train it in full")
        value = values.get(role)
        value = var[...] if value is None else _layout(role, value, var.shape)
        setattr(_holder(model, role), _PATHS[role][1], SavedParam(jnp.asarray(value, jnp.float32),
                                                                  **var.get_metadata()))
    for role, ids in rows.items():
        holder, var = _holder(model, role), _var(model, role)
        if var is None:
            raise ConfigError("trainable_token_indices: the output head is stored quantised (load_in_4bit / FP8); "
                              "list lm_head in llm_int8_skip_modules to train its rows")
        index = jnp.asarray(ids, jnp.int32)
        value = values.get(role)
        if value is None:
            value = var[...][index] if role == EMBED else var[...][:, index].T
        elif tuple(value.shape) != (len(ids), var.shape[1 if role == EMBED else 0]):
            raise ValueError(f"trained rows of {role}: shape {tuple(value.shape)}, expected "
                             f"{(len(ids), var.shape[1 if role == EMBED else 0])}")
        holder.token_rows = nnx.data(TokenRows(jnp.asarray(value, jnp.float32), **logical(None, "embed")))
        holder.token_ids = nnx.data(TokenIds(index))


def _holder(model, role: str):
    return model.embed if role == EMBED else model.lm_head


def _var(model, role: str):
    holder = _holder(model, role)
    return None if holder is None else getattr(holder, _PATHS[role][1], None)


def _layout(role: str, value, shape) -> np.ndarray:
    """A full table as PEFT stores it ([V, H], torch's layout) in the variable's layout (the head: [H, V])."""
    value = np.asarray(value, np.float32)
    if role == HEAD:
        value = value.T
    if tuple(value.shape) != tuple(shape):
        vocab = value.shape[0 if role == EMBED else 1]
        hint = (f"; the adapter has new tokens: grow the base first with jaxft.lora.resize_embeddings(model, {vocab})"
                if vocab > shape[0 if role == EMBED else 1] else "")
        raise ValueError(f"a trained {role} of shape {tuple(value.shape)} does not fit this model's {tuple(shape)}"
                         f"{hint}")
    return value


def _untie(model) -> None:
    """Gives a tied model an output head of its own, a copy of the embedding table ([H, V])."""
    table = model.embed.embedding[...]
    head = Linear(table.shape[1], table.shape[0], bias=False, stack=(), dtype=table.dtype, rngs=None,
                  axes=("embed", "vocab"))
    head.kernel = nnx.Param(jnp.asarray(table.T), **logical("embed", "vocab"))
    model.lm_head = nnx.data(head)
    model.config = dataclasses.replace(model.config, tie_word_embeddings=False)  # a merged export has both


def exported(model) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """({HF module name: trained table [V, H]}, {HF module name: trained rows [n, H]}) in PEFT's layout."""
    names, full, rows = module_names(model), {}, {}
    for role in (EMBED, HEAD):
        var = _var(model, role)
        if isinstance(var, SavedParam):
            value = np.asarray(var[...], np.float32)
            full[names[role]] = value if role == EMBED else value.T
        holder = _holder(model, role)
        if holder is not None and getattr(holder, "token_rows", None) is not None:
            rows[names[role]] = np.asarray(holder.token_rows[...], np.float32)
    cfg = model.lora_config
    if model.lm_head is None and EMBED in names and names[EMBED] in full and cfg.ensure_weight_tying:
        full[names[HEAD]] = full[names[EMBED]]  # PEFT ties the head to the trained table and saves both
    return full, rows


def adopt_base_tables(model, tables: Mapping[str, np.ndarray], source) -> None:
    """Makes the resized base tables PEFT stores with an adapter of new tokens ({HF module name: weight [V', H]})
    the model's frozen tables, growing the vocabulary to V' where the model is smaller (`resize_embeddings` for a
    table the adapter does not hold), so the untrained new rows are PEFT's too."""
    if not tables:
        return
    names = module_names(model)
    roles = {name: role for role, name in names.items()}
    unknown = sorted(set(tables) - set(roles))
    if unknown:
        raise peft_io.AdapterError(f"{source}: full weights for {unknown[0]}, which is neither the embeddings nor "
                                   "the output head; jaxft cannot load them")
    vocab = {int(np.asarray(t).shape[0]) for t in tables.values()}
    if len(vocab) > 1 or min(vocab) < model.config.vocab_size:
        raise peft_io.AdapterError(f"{source}: resized base tables of {sorted(vocab)} rows do not fit this model's "
                                   f"{model.config.vocab_size}; was the adapter trained for a different base model?")
    resize_embeddings(model, vocab.pop())
    for name, value in tables.items():
        role = roles[name]
        if role == HEAD and model.lm_head is None:
            continue  # a tied head: PEFT stored the embedding table again
        var = _var(model, role)
        setattr(_holder(model, role), _PATHS[role][1],
                nnx.Param(jnp.asarray(_layout(role, value, var.shape), var.dtype), **var.get_metadata()))


def values_of(model, cfg: LoraConfig, full: Mapping[str, np.ndarray], rows: Mapping[str, np.ndarray],
              source) -> dict[str, np.ndarray]:
    """An adapter's trained tables and rows ({HF module name: array}) as `install`'s {role: array}; errors
    (naming `source`) for a module `cfg` does not train or one it trains without weights."""
    names = module_names(model)
    saved, token_rows = plan(model, cfg)
    want_full = {names[r]: r for r in saved}
    want_rows = {names[r]: r for r in token_rows}
    if model.lm_head is None and EMBED in token_rows:
        want_rows.setdefault(names[HEAD], EMBED)  # a tied head's rows are the embedding's (not stored by PEFT)
    tied_copy = model.lm_head is None and cfg.ensure_weight_tying and EMBED in saved
    out = {}
    for kind, given, want in (("modules_to_save", full, want_full), ("trainable tokens", rows, want_rows)):
        for name, value in given.items():
            if name not in want and not (tied_copy and name == names.get(HEAD)):
                raise peft_io.AdapterError(f"{source}: {kind} weights for {name}, which the adapter config does "
                                           "not train on this model; was it trained for a different base model?")
            if name in want:
                out.setdefault(want[name], value)
    missing = [names[r] for r in saved | set(token_rows) if r not in out]
    if missing:
        raise peft_io.AdapterError(f"{source}: no trained weights for {missing[0]}, which the adapter config "
                                   "trains (modules_to_save / trainable_token_indices); re-export the adapter")
    return out


def row_tables(model) -> dict[tuple[str, ...], str]:
    """{("embed", "embedding") / ("lm_head", "kernel"): role} of the tables that have trained rows."""
    return {_PATHS[role]: role for role in (EMBED, HEAD)
            if _holder(model, role) is not None and getattr(_holder(model, role), "token_rows", None) is not None}


def table_with_rows(model, key: tuple[str, ...]) -> jax.Array:
    """The table at `key` (see `row_tables`) with its trained rows written in (what a merged export writes)."""
    role = row_tables(model)[tuple(key)]
    holder = _holder(model, role)
    return with_token_rows(getattr(holder, _PATHS[role][1])[...], holder, 0 if role == EMBED else 1)


def merge(model) -> None:
    """Folds trained tables and rows into the frozen base (a `SavedParam` becomes an `nnx.Param` of the model's
    dtype; trained rows are written into their table)."""
    dtype = getattr(model, "dtype", jnp.float32)
    for role in (EMBED, HEAD):
        holder = _holder(model, role)
        if holder is None:
            continue
        var = getattr(holder, _PATHS[role][1], None)
        if getattr(holder, "token_rows", None) is not None:
            var[...] = with_token_rows(var[...], holder, 0 if role == EMBED else 1)
            holder.token_rows = holder.token_ids = nnx.static(None)
        if isinstance(var, SavedParam):
            setattr(holder, _PATHS[role][1], nnx.Param(var[...].astype(dtype), **var.get_metadata()))


# transformers scales the old rows' covariance by this before sampling new rows from it (mean_resizing=True).
_MEAN_RESIZING_EPS = 1e-9


def _mean_rows(table: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` rows drawn from N(mean, 1e-9 * cov) of `table`'s rows [V, H] (cov = centered^T centered / V), or the
    mean itself where that covariance is not positive definite: transformers' `_init_added_embeddings_weights_
    with_mean`. The spread is 3e-5 of the rows' own: the new rows are the mean, up to noise."""
    x = np.asarray(table, np.float32)
    mean = x.mean(axis=0)
    centered = x - mean
    cov = (centered.T @ centered / x.shape[0]).astype(np.float64) * _MEAN_RESIZING_EPS
    try:
        chol = np.linalg.cholesky(cov)
    except np.linalg.LinAlgError:
        return np.broadcast_to(mean, (count, x.shape[1])).copy()
    return (mean + rng.standard_normal((count, x.shape[1])) @ chol.T).astype(np.float32)


def resize_embeddings(model, vocab_size: int, *, seed: int = 0) -> None:
    """Grows the embedding table (and an untied head) of `model` to `vocab_size` rows in place, as transformers'
    `model.resize_token_embeddings(vocab_size)` (mean_resizing=True) does: old rows kept, new rows drawn from a
    normal with the old rows' mean and 1e-9 times their covariance (the head's from the head's rows). The draws
    are jaxft's own (seeded), so they equal transformers' only in distribution. Call it before `apply_lora`."""
    old = model.config.vocab_size
    if not isinstance(vocab_size, int) or vocab_size < old:
        raise ValueError(f"resize_embeddings: vocab_size={vocab_size!r} must be an integer >= the model's {old} "
                         "(shrinking the vocabulary is not supported)")
    if getattr(model, "lora_config", None) is not None:
        raise ValueError("resize_embeddings: the model has adapters already; resize the base before apply_lora")
    if vocab_size == old:
        return
    if model.lm_head is not None and getattr(model.lm_head, "kernel", None) is None:
        raise ValueError("resize_embeddings: the output head is stored quantised; keep lm_head in "
                         "llm_int8_skip_modules")
    rng = np.random.default_rng([seed, vocab_size])
    var = model.embed.embedding
    table = np.asarray(var[...].astype(jnp.float32))
    grown = np.concatenate([table, _mean_rows(table, vocab_size - old, rng)])
    model.embed.embedding = nnx.Param(jnp.asarray(grown, var.dtype), **var.get_metadata())
    if model.lm_head is not None:
        var = model.lm_head.kernel
        head = np.asarray(var[...].astype(jnp.float32)).T
        grown = np.concatenate([head, _mean_rows(head, vocab_size - old, rng)])
        model.lm_head.kernel = nnx.Param(jnp.asarray(grown.T, var.dtype), **var.get_metadata())
        model.lm_head.out_features = vocab_size
    model.config = dataclasses.replace(model.config, vocab_size=vocab_size)


def new_token_config(cfg: LoraConfig, ids: Sequence[int], tied: bool) -> LoraConfig:
    """`cfg` with token rows `ids` (new tokens) trained: added to trainable_token_indices for the embeddings
    (and an untied head, whose new rows need training as much), except where modules_to_save trains a table in
    full already."""
    ids = [int(i) for i in ids]
    if not ids:
        return cfg
    saved = cfg.modules_to_save or ()
    rows = dict(cfg.token_index_map)
    def names(entry: str, module: str) -> bool:  # an entry written as the module's name or a dotted path to it
        return entry == module or entry.endswith("." + module)

    for module in ("embed_tokens",) + (() if tied else ("lm_head",)):
        if any(names(s, module) for s in saved):
            continue
        key = next((k for k in rows if names(k, module)), module)
        rows[key] = tuple(dict.fromkeys([*rows.get(key, ()), *ids]))
    return dataclasses.replace(cfg, trainable_token_indices=rows or None)
