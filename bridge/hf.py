"""Hugging Face checkpoint directories <-> flat parameter trees.

Load: ``load_weights`` maps every safetensors tensor of a checkpoint to a
path of our tree through a mapping table (``bridge.mappings``), checks the set
and the shapes against what the model expects, and fills preallocated arrays
of the target dtype. Per-layer tensors land in ``out[path][i]`` (stacked on a
leading L axis); linear weights are transposed ``[out, in] -> [in, out]``.
Host memory peaks at one copy of the result plus a fixed scratch buffer:
tensor bytes are read with ``pread`` directly into the result (or through
the scratch when casting / transposing), nothing holds a whole shard.

Save: ``save_weights`` is the inverse (un-stack, transpose back), writing
``config.json``, safetensors shards and the index into a temporary directory
that is renamed onto the target at the end.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from bridge import gguf
from bridge.errors import CheckpointError, hub_id_hint, python_command
from bridge.mappings import transforms
from bridge.mappings.schema import LayerMap, Row, Table, rows_by_path, stack_layers, validate_table
from bridge.safetensors_io import PendingTensor, TensorInfo, new_temp_dir, read_header, read_into, write_file
from bridge.tree import flatten_tree, unflatten_tree  # re-exported: bridge.hf is the one-stop I/O module

__all__ = [
    "CheckpointError",
    "checkpoint_files",
    "flatten_tree",
    "load_weights",
    "read_config",
    "save_weights",
    "unflatten_tree",
]

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # HF's "5GB"
_SCRATCH_BYTES = 64 * 2**20
_LOAD_THREADS = 8
_LIST_LIMIT = 25  # how many offending names an error message lists
_FLOATS = tuple(np.dtype(d) for d in (np.float32, np.float16, np.float64, ml_dtypes.bfloat16))
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Model and tokenizer both: the converted directory must load in jaxft as it is. dtype="auto" keeps the
# stored precision (transformers would otherwise load, and save, float32).
_CONVERT_CODE = (
    "from transformers import AutoModelForCausalLM as M, AutoTokenizer as T; "
    'M.from_pretrained({DIR}, dtype="auto").save_pretrained({OUT}); T.from_pretrained({DIR}).save_pretrained({OUT})'
)
_LM_HEAD = ("lm_head", "kernel")
_EMBED = ("embed", "embedding")


# --------------------------------------------------------------------------- config


def _read_json(file: Path, what: str) -> Any:
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read {what} ({e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{file}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}; fix or re-download the {what}"
        ) from None


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read ``<path>/config.json`` (or ``path`` itself if it is a file) as a dict; a ``.gguf`` file's metadata
    as the config dict it describes (``bridge.gguf``)."""
    path = Path(path)
    if gguf.is_gguf(path):
        return gguf.read_config(path)
    if not path.exists():
        hint = hub_id_hint(path) or "; pass a local HF model directory"
        raise CheckpointError(f"checkpoint path {path} does not exist{hint}")
    file = path if path.is_file() else path / CONFIG_NAME
    if not file.is_file():
        raise CheckpointError(
            f"{path} has no {CONFIG_NAME}; an HF model directory needs one (save it with "
            "model.config.save_pretrained(DIR) or download it with the weights)"
        )
    config = _read_json(file, CONFIG_NAME)
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: top level must be a JSON object, got {type(config).__name__}")
    return config


# --------------------------------------------------------------------------- helpers


def _as_float_dtype(dtype: Any, where: str) -> np.dtype:
    if isinstance(dtype, str) and hasattr(ml_dtypes, dtype):
        dtype = getattr(ml_dtypes, dtype)  # "bfloat16" is not a numpy name
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"{where}: {dtype!r} is not a dtype") from None
    if dt not in _FLOATS:
        raise ValueError(f"{where}: dtype {dt} unsupported; use one of float32, bfloat16, float16, float64")
    return dt


def _spec(value: Any, where: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) from a jax.ShapeDtypeStruct-like object or a (shape, dtype) pair."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        shape, dtype = value.shape, value.dtype
    else:
        try:
            shape, dtype = value
        except (TypeError, ValueError):
            raise ValueError(f"{where}: expected a ShapeDtypeStruct or (shape, dtype), got {value!r}") from None
    return tuple(int(d) for d in shape), _as_float_dtype(dtype, where)


def _hf_shape(row: Row, ours: tuple[int, ...], path_str: str) -> tuple[int, ...]:
    """HF shape of one tensor of ``row`` given our shape (with its leading layer / expert axes)."""
    per = ours[len(row.axes):]
    try:
        if row.part is not None:  # one block of the last axis
            width = row.part_slice(per[-1] if per else 0)
            per = (*per[:-1], width.stop - width.start)
        return transforms.hf_shape(row.transform, per)
    except ValueError as e:
        raise ValueError(f"{path_str}: {e} (per layer/expert; our shape {ours})") from None


def _check_lead(row: Row, shape: tuple[int, ...], sizes: Mapping[str, int], where: str) -> None:
    """Our array of a row has one leading axis per placeholder, of the placeholder's count."""
    want = tuple(int(sizes[a]) for a in row.axes if a in sizes)
    names = {"i": "num_layers", "e": "num_experts", "v": "num_vision_blocks"}
    if len(want) != len(row.axes) or tuple(shape[:len(want)]) != want:
        need = ", ".join(f"{names[a]}={sizes.get(a, '?')}" for a in row.axes)
        kind = "per layer" if row.axes == ("i",) else f"indexed by {row.axes}"
        raise ValueError(f"{where} is {kind}: shape {shape} must start with {need}")


def _path_str(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _listing(items: list[str]) -> str:
    shown = "\n  ".join(items[:_LIST_LIMIT])
    more = f"\n  ... and {len(items) - _LIST_LIMIT} more" if len(items) > _LIST_LIMIT else ""
    return "\n  " + shown + more


def checkpoint_files(root: Path) -> list[Path]:
    """The safetensors files of an HF model directory (the index's shards, or model.safetensors)."""
    if not root.exists():
        raise CheckpointError(f"checkpoint directory {root} does not exist{hub_id_hint(root)}")
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory; pass the HF model directory that holds it")
    index = root / INDEX_FILE
    if index.exists():
        data = _read_json(index, INDEX_FILE)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map' object; the index is corrupt, re-download it")
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(str(shard), []).append(name)
        for s in by_shard:  # a file name of this directory (links are fine: the HF cache links shards to blobs)
            if Path(s).name != s or s in (".", ".."):
                raise CheckpointError(f"{index}: shard {s!r} (of tensor {by_shard[s][0]}) is not a file of {root}; "
                                      "an index names files beside it: fix or re-download the index")
        missing = [s for s in by_shard if not (root / s).is_file()]
        if missing:
            lines = [f"{s} (holds {len(by_shard[s])} tensors, e.g. {by_shard[s][0]})" for s in missing]
            raise CheckpointError(
                f"{index} references shard files missing from {root}:{_listing(lines)}\n"
                "the download is incomplete: fetch the missing shards (e.g. huggingface-cli download again)"
            )
        return [root / s for s in sorted(by_shard)]
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        out = root.with_name(root.name + "-safetensors")
        raise CheckpointError(
            f"{root} holds only pickle checkpoints ({', '.join(pickles[:5])}); these are refused because "
            f"unpickling runs arbitrary code. Convert it once with `{python_command(_CONVERT_CODE, DIR=root, OUT=out)}` "
            f"(transformers unpickles it: only run this on files you trust), then load {out}"
        )
    others = sorted(p.name for p in root.glob("*.safetensors"))
    found = f" (found {', '.join(others[:5])}: not an HF model file name)" if others else ""
    raise CheckpointError(f"{root} has no {SINGLE_FILE} or {INDEX_FILE}{found}; pass an HF model directory")


# --------------------------------------------------------------------------- load


def _locate(root: Path, table: Table, expected: Mapping[tuple, Any], num_layers: int, dtype: Any,
            num_experts: int | None, ignore: Collection[str] = (), layer_map: LayerMap | None = None,
            num_vision_blocks: int | None = None):
    """Pass 1 of a load, headers only: every problem is found (and raised) before any data is read.

    Returns (wants: HF name -> (path, index, row, hf_shape), specs: path -> (shape, dtype), files,
    located: HF name -> (file, TensorInfo))."""
    validate_table(table)
    num_layers = int(num_layers)
    override = None if dtype is None else _as_float_dtype(dtype, "load_weights(dtype=...)")
    by_path = rows_by_path(table)

    sizes = _sizes(num_layers, num_experts, num_vision_blocks)
    # What the model wants, by concrete HF name: name -> (path, index, row, hf_shape).
    wants: dict[str, tuple[tuple, tuple[int, ...], Row, tuple[int, ...]]] = {}
    specs: dict[tuple, tuple[tuple[int, ...], np.dtype]] = {}
    for p, value in expected.items():
        ps = _path_str(p)
        if p not in by_path:
            raise ValueError(f"expected path {ps} has no HF name in the mapping table; add a Row for it")
        shape, dt = _spec(value, f"expected[{ps}]")
        specs[p] = (shape, dt if override is None else override)
        for row in by_path[p]:  # one row, or one per part of the path
            layers = stack_layers(row, layer_map, num_layers)
            row_sizes = sizes if layers is None else {**sizes, "i": len(layers)}
            _check_lead(row, shape, row_sizes, f"expected[{ps}]")
            hf_shape = _hf_shape(row, shape, ps)
            for index in row.indices(row_sizes):
                name = row.name_at(index, layers)
                if name in wants:
                    raise ValueError(f"{name} maps to both {_path_str(wants[name][0])} and {ps}: the layer_map puts "
                                     "one layer in two stacks")
                wants[name] = (p, index, row, hf_shape)

    # Pass 1: headers only. Find every problem before reading any data.
    files = checkpoint_files(root)
    located: dict[str, tuple[Path, TensorInfo]] = {}
    unexpected: list[str] = []
    misshaped: list[str] = []
    bad_dtype: list[str] = []
    embed_want = wants.get(by_path[_EMBED][0].name()) if _EMBED in by_path else None
    embed_shape = None if embed_want is None else embed_want[3]
    for file in files:
        infos, _ = read_header(file)
        for name, info in infos.items():
            if name in ignore:
                continue
            if name in located:
                raise CheckpointError(f"tensor {name!r} appears in both {located[name][0]} and {file}; re-save the checkpoint")
            want = wants.get(name)
            if want is None:
                if _is_tied_head(name, info, by_path, expected, embed_shape):
                    continue
                unexpected.append(f"{name} {list(info.shape)} in {file.name}{_why_unexpected(name, table, expected, sizes)}")
                continue
            located[name] = (file, info)
            if info.shape != want[3]:
                misshaped.append(
                    f"{name} in {file.name}: got {list(info.shape)}, expected {list(want[3])} "
                    f"(for {_path_str(want[0])} {list(specs[want[0]][0])})"
                )
            elif info.dtype is None or info.dtype not in _FLOATS:
                bad_dtype.append(f"{name} in {file.name}: dtype {info.code}")
    missing = [f"{n} (expected shape {list(w[3])})" for n, w in wants.items() if n not in located]
    _raise_problems(root, missing, unexpected, misshaped, bad_dtype)
    return wants, specs, files, located


def load_weights(
    path: str | os.PathLike,
    table: Table,
    expected: Mapping[tuple, Any],
    num_layers: int,
    dtype: Any = None,
    *,
    num_experts: int | None = None,
    ignore: Collection[str] = (),
    layer_map: LayerMap | None = None,
    num_vision_blocks: int | None = None,
) -> dict[tuple, np.ndarray]:
    """Load an HF safetensors checkpoint into flat tree arrays.

    Args:
      path: HF model directory (``model.safetensors`` or index + shards).
      table: mapping table, e.g. ``bridge.mappings.table_for(config["model_type"])``.
      expected: exactly the tree paths the model has -> ``jax.ShapeDtypeStruct``
        or ``(shape, dtype)``; stacked paths include the leading ``num_layers``.
      num_layers: L, the number of decoder layers.
      dtype: if given, every output uses it instead of the per-path dtype.
      num_experts: E, for rows with an ``{e}`` placeholder (MoE experts).
      num_vision_blocks: the vision tower's depth, for rows with a ``{v}`` placeholder.
      ignore: tensor names another reader takes (``bridge.bnb4bit``: 4-bit weights and their statistics);
        they are neither loaded nor reported as unexpected.
      layer_map: {layer stack (a path's first name): the HF layer of each of its rows} for a model whose
        layers are in several stacks (``bridge.mappings.schema``); default: row i of ``layers`` is layer i.

    Returns:
      ``{path: np.ndarray}`` with the expected shapes/dtypes (bf16 is
      ``ml_dtypes.bfloat16``). ``out[p][i] == hf[name_i].T`` for stacked
      transposed rows, and so on.

    Raises CheckpointError (a ValueError) for pickle-only directories, missing
    / unexpected / mis-shaped tensors, corrupt or truncated files, and index
    entries pointing at absent shards. A tied model (no ``lm_head.kernel``
    expected) silently skips a file ``lm_head.weight`` shaped like the embedding.
    """
    root = Path(path)
    wants, specs, files, located = _locate(root, table, expected, num_layers, dtype, num_experts, ignore, layer_map,
                                           num_vision_blocks)

    # Pass 2: data into preallocated outputs. Host-side transposes run at ~1 GB/s per core, so tensors are
    # spread over a few threads (pread and numpy copies release the GIL); each thread reads its tensors in
    # offset order with its own scratch buffer, so extra memory is threads x _SCRATCH_BYTES.
    out = {p: np.empty(shape, dt) for p, (shape, dt) in specs.items()}
    fds = {file: os.open(file, os.O_RDONLY) for file in files}
    jobs = sorted((str(f), info.start, name) for name, (f, info) in located.items())
    workers = max(1, min(_LOAD_THREADS, os.cpu_count() or 1, len(jobs)))

    def run(part: list[tuple[str, int, str]]) -> None:
        scratch = np.empty(_SCRATCH_BYTES, np.uint8)
        for _, _, name in part:
            p, index, row, _ = wants[name]
            file, info = located[name]
            dst = out[p][index]
            if row.part is not None:  # its block of the last axis (a strided view: read_into fills it in place)
                dst = dst[..., row.part_slice(dst.shape[-1])]
            if row.transform in (None, "transpose"):  # streamed (cast / blocked transpose) into place
                read_into(fds[file], file, info, dst, row.transform, scratch)
            else:  # another named transform: the HF tensor whole, then its registered load
                hf = np.empty(info.shape, info.dtype)
                read_into(fds[file], file, info, hf, None, scratch)
                dst[...] = transforms.to_ours(row.transform, hf)

    try:
        if workers == 1:
            run(jobs)
        else:
            with ThreadPoolExecutor(workers) as pool:  # strided split: each thread gets every kind of tensor
                for f in [pool.submit(run, jobs[i::workers]) for i in range(workers)]:
                    f.result()
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def _is_tied_head(name, info, by_path, expected, embed_shape) -> bool:
    head = by_path.get(_LM_HEAD)
    return (
        head is not None
        and name == head[0].hf
        and _LM_HEAD not in expected
        and embed_shape is not None
        and info.shape == embed_shape
    )


def _sizes(num_layers: int, num_experts: int | None, num_vision_blocks: int | None = None) -> dict[str, int]:
    sizes = {"i": int(num_layers)}
    if num_experts is not None:
        sizes["e"] = int(num_experts)
    if num_vision_blocks is not None:
        sizes["v"] = int(num_vision_blocks)
    return sizes


def _why_unexpected(name: str, table: Table, expected: Mapping, sizes: Mapping[str, int]) -> str:
    what = {"i": ("layer", "num_layers"), "e": ("expert", "num_experts"), "v": ("vision block", "num_vision_blocks")}
    for row in table:
        m = row.pattern().fullmatch(name)
        if m is None:
            continue
        for axis in row.axes:
            if axis in sizes and int(m.group(axis)) >= sizes[axis]:
                word, key = what[axis]
                return f" ({word} {m.group(axis)} but the model has {key}={sizes[axis]})"
        if row.path not in expected:
            return f" (maps to {_path_str(row.path)}, which the model does not have)"
    return " (no row in the mapping table)"


def _raise_problems(root, missing, unexpected, misshaped, bad_dtype) -> None:
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} tensors the model expects are missing:{_listing(missing)}\n"
            "fix: check that config.json matches the weights (num_hidden_layers, attention_bias, "
            "tie_word_embeddings, model_type) and that every shard downloaded"
        )
    if unexpected:
        parts.append(
            f"{len(unexpected)} tensors in the checkpoint are not used by the model:{_listing(unexpected)}\n"
            "fix: the weights belong to a different config/architecture; check model_type, num_hidden_layers, "
            "attention_bias/mlp_bias and tie_word_embeddings in config.json"
        )
    if misshaped:
        parts.append(
            f"{len(misshaped)} tensors have the wrong shape (HF layout):{_listing(misshaped)}\n"
            "fix: config.json sizes (hidden_size, intermediate_size, num_attention_heads, "
            "num_key_value_heads, head_dim, vocab_size) disagree with the weights"
        )
    if bad_dtype:
        parts.append(
            f"{len(bad_dtype)} tensors are not float16/bfloat16/float32/float64:{_listing(bad_dtype)}\n"
            "fix: quantized checkpoints are not supported; use an unquantized bf16/fp16/fp32 checkpoint"
        )
    if parts:
        raise CheckpointError(f"checkpoint {root} does not match the model:\n" + "\n".join(parts))


# --------------------------------------------------------------------------- save


def save_weights(
    path: str | os.PathLike,
    table: Table,
    params: Mapping[tuple, Any],
    num_layers: int,
    config: Mapping[str, Any],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: Any = None,
    *,
    overwrite: bool = False,
    num_experts: int | None = None,
    extra: Sequence[PendingTensor] = (),
    layer_map: LayerMap | None = None,
    num_vision_blocks: int | None = None,
    files: Mapping[str, str] | None = None,
) -> Path:
    """Write an HF checkpoint directory loadable by ``AutoModelForCausalLM.from_pretrained``.

    Args:
      path: target directory. Written atomically: everything goes to a temp
        dir next to it, renamed onto ``path`` at the end.
      table: the mapping table.
      params: flat ``{path: array}`` (numpy or jax); only these tensors are
        written. Stacked arrays are split into per-layer tensors, transform rows
        transposed back to ``[out, in]``.
      num_layers: L (leading dim of every stacked array).
      config: HF config dict written as config.json (e.g. ModelConfig.to_hf()).
      max_shard_bytes: shard size cap; a single shard is written as
        ``model.safetensors`` (no index, like HF), more as
        ``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json``.
      dtype: cast every tensor to this dtype (default: keep each array's dtype).
      overwrite: replace an existing non-empty ``path``; otherwise that is an error.
      num_experts: E, for rows with an ``{e}`` placeholder (MoE experts).
      num_vision_blocks: the vision tower's depth, for rows with a ``{v}`` placeholder.
      extra: tensors written as they are after the table's (``bridge.bnb4bit``: 4-bit weights).
      layer_map: as for ``load_weights``.
      files: more text files of the directory, name -> content (e.g. generation_config.json).

    Returns the target path.
    """
    target = Path(path)
    validate_table(table)
    num_layers = int(num_layers)
    if int(max_shard_bytes) <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a dict (HF config.json contents), got {type(config).__name__}")
    try:
        config_text = json.dumps(dict(config), indent=2, sort_keys=True) + "\n"
    except (TypeError, ValueError) as e:
        raise ValueError(f"config is not JSON serializable: {e}") from None
    if target.exists() and not target.is_dir():
        raise ValueError(f"save target {target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ValueError(f"save target {target} exists and is not empty; pass overwrite=True to replace it")
    tensors = _pending_tensors(table, params, _sizes(num_layers, num_experts, num_vision_blocks), dtype,
                               layer_map) + list(extra)

    shards: list[list[PendingTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_temp_dir(target)
    try:
        (tmp / CONFIG_NAME).write_text(config_text, encoding="utf-8")
        for name, text in (files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        for name, shard in zip(names, shards):
            write_file(tmp / name, shard, {"format": "pt"})
        if n > 1:
            index = {
                "metadata": {
                    "total_size": sum(t.nbytes for t in tensors),
                    "total_parameters": sum(math.prod(t.shape) for t in tensors),
                },
                "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard},
            }
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        _swap_into_place(tmp, target, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def hf_tensors(table: Table, params: Mapping[tuple, Any], num_layers: int, *, dtype: Any = None,
               layer_map: LayerMap | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) of every tensor `save_weights` would write, in its order, made one at a time."""
    for t in _pending_tensors(table, params, _sizes(num_layers, None), dtype, layer_map):
        yield t.name, t.produce()


def _pending_tensors(table: Table, params: Mapping[tuple, Any], sizes: Mapping[str, int],
                     dtype: Any, layer_map: LayerMap | None = None) -> list[PendingTensor]:
    by_path = rows_by_path(table)
    unknown = [_path_str(p) for p in params if p not in by_path]
    if unknown:
        raise ValueError(
            f"params has paths with no HF name in the mapping table:{_listing(unknown)}\n"
            "fix: merge or drop LoRA/optimizer entries before save_weights (pass base weights only)"
        )
    override = None if dtype is None else _as_float_dtype(dtype, "save_weights(dtype=...)")
    flat: list[PendingTensor] = []
    per_layer: list[tuple[Row, Any, np.dtype, tuple[int, ...], dict[int, int]]] = []
    num_layers = sizes["i"]
    for row in table:  # table order gives a stable, HF-like file order
        if row.path not in params:
            continue
        arr = params[row.path]
        ps = _path_str(row.path)
        shape = tuple(int(d) for d in arr.shape)
        dt = _as_float_dtype(arr.dtype if override is None else override, f"params[{ps}]")
        layers = stack_layers(row, layer_map, num_layers)
        _check_lead(row, shape, sizes if layers is None else {**sizes, "i": len(layers)}, f"params[{ps}]")
        hf_shape = _hf_shape(row, shape, ps)
        if row.stacked:
            per_layer.append((row, arr, dt, hf_shape, {layer: r for r, layer in enumerate(layers)}))
        else:
            for index in row.indices(sizes):
                flat.append(PendingTensor(row.name_at(index), hf_shape, dt, _producer(arr, index, row, dt)))
    for layer in range(num_layers):  # layer-major file order, as transformers writes
        for row, arr, dt, hf_shape, rows in per_layer:
            if layer not in rows:  # the layer is in another stack
                continue
            for index in row.indices({**sizes, "i": 1}):
                index = (rows[layer], *index[1:])
                flat.append(PendingTensor(row.name(**{**dict(zip(row.axes, index)), "i": layer}), hf_shape, dt,
                                          _producer(arr, index, row, dt)))
    return flat


def _producer(arr: Any, index: tuple[int, ...], row: Row, dt: np.dtype):
    def produce() -> np.ndarray:
        # Index before converting: a jax array then moves one layer to host, not all L.
        x = arr
        for k in index:  # one axis at a time: works for any array-like that indexes by int
            x = x[k]
        if row.part is not None:  # the row's block of the last axis, sliced before it moves to host
            x = x[..., row.part_slice(x.shape[-1])]
        x = np.asarray(x)
        x = x.astype(dt, copy=False)
        return np.ascontiguousarray(transforms.to_hf(row.transform, x))

    return produce


def _swap_into_place(tmp: Path, target: Path, overwrite: bool) -> None:
    if not target.exists():
        os.rename(tmp, target)
        return
    if any(target.iterdir()) and not overwrite:  # appeared while we were writing
        raise ValueError(f"save target {target} became non-empty during save; pass overwrite=True to replace it")
    old = new_temp_dir(target, "old")
    os.rename(target, old / "prev")  # the target is absent only between these two renames
    os.rename(tmp, target)
    shutil.rmtree(old, ignore_errors=True)
