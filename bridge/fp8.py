"""FP8 linear weights in HF checkpoints, dequantised on import to the compute dtype.

Two layouts, each a float8_e4m3fn `<module>.weight` [out, in] plus float32 scales:

* transformers' fine-grained FP8 (`quantization_config.quant_method: "fp8"`, `weight_block_size: [bm, bn]`):
  `<module>.weight_scale_inv` [out/bm, in/bn], one factor per block: w = fp8 * scale_inv[row // bm, col // bn].
  As transformers' `Fp8Dequantize`, the block is read from the scale grid (rows / grid rows), the product taken
  in float32 and cast to the compute dtype once.
* compressed-tensors FP8 (`quant_method: "compressed-tensors"`, weights `type: float`, `num_bits: 8`, strategy
  `channel` or `tensor`): `<module>.weight_scale` [out, 1] or [1] (or a scalar): w = fp8 * scale. The
  activations' `input_scale` (static activation quantisation) is dropped: jaxft computes in the compute dtype.

Every other FP8 layout (block strategy of compressed-tensors, FP8 scales, other bit widths) is one CheckpointError.

MoE experts stored per expert (`<...>.experts.{e}.<proj>.weight`, Qwen3-MoE) are read as stored instead
(`load_expert_rows`): codes [L, E, out, in] and a scale grid [L, E, out / bm, in / bn] per tree path, the parts of a
fused weight (gate rows, then up rows) concatenated along `out`, for jaxft to keep in FP8 (or `dequantize_experts`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from bridge.errors import CheckpointError
from bridge.mappings.schema import LayerMap, Row, stack_layers
from bridge.safetensors_io import TensorInfo, read_header

FINE_GRAINED, COMPRESSED = "weight_scale_inv", "weight_scale"  # the scale tensor's suffix names the layout
_FP8_CODE = "F8_E4M3"


def scale_suffix(config: Mapping[str, Any], source: str) -> str | None:
    """The scale suffix of an FP8 checkpoint's config.json (None when it is not FP8); one line for an FP8
    layout jaxft does not read."""
    q = config.get("quantization_config")
    if not isinstance(q, Mapping):
        return None
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) for b in block)):
            raise CheckpointError(f"{source}: quantization_config.weight_block_size={block!r}; jaxft reads "
                                  "fine-grained FP8 with a [rows, cols] block (transformers' FineGrainedFP8Config)")
        if q.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"{source}: quantization_config.fmt={q.get('fmt')!r}; jaxft reads e4m3 FP8 weights")
        return FINE_GRAINED
    if method == "compressed-tensors":
        groups = q.get("config_groups") or {}
        for name, group in groups.items():
            w = (group or {}).get("weights") or {}
            ok = w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") in ("channel", "tensor")
            if not ok:
                raise CheckpointError(
                    f"{source}: quantization_config.config_groups.{name}.weights is {w.get('type')} "
                    f"{w.get('num_bits')}-bit, strategy {w.get('strategy')!r}; jaxft reads compressed-tensors FP8 "
                    "weights (type float, num_bits 8) with per-channel or per-tensor scales")
        if not groups:
            raise CheckpointError(f"{source}: compressed-tensors quantization_config has no config_groups")
        return COMPRESSED
    return None


def quantized_rows(table: Sequence[Row], names: set[str], suffix: str, layer_map: LayerMap | None = None,
                   num_layers: int = 1) -> list[Row]:
    """The per-layer linear weight rows stored as FP8 (the first layer of their stack, layer 0 without a
    `layer_map`, has the scale tensor beside its weight)."""
    out = []
    for row in table:
        if row.axes != ("i",) or not row.hf.endswith(".weight") or not row.transform:
            continue
        layers = stack_layers(row, layer_map, num_layers)
        if layers and row.name(layers[0])[: -len("weight")] + suffix in names:
            out.append(row)
    return out


def tensor_names(rows: Sequence[Row], num_layers: int, names: set[str], suffix: str,
                 layer_map: LayerMap | None = None) -> list[str]:
    """Every on-disk tensor the FP8 rows take: weights, scales and (compressed-tensors) activation scales."""
    out = []
    for row in rows:
        for i in stack_layers(row, layer_map, num_layers):
            stem = row.name(i)[: -len("weight")]
            out += [n for n in (stem + "weight", stem + suffix, stem + "input_scale") if n in names]
    return out


def _read(fd: int, info: TensorInfo) -> np.ndarray:
    raw = os.pread(fd, info.nbytes, info.start)
    if len(raw) != info.nbytes:
        raise CheckpointError(f"{info.name}: file truncated")
    if info.code == _FP8_CODE:
        return np.frombuffer(raw, ml_dtypes.float8_e4m3fn).reshape(info.shape).astype(np.float32)
    if info.dtype is None:
        raise CheckpointError(f"{info.name}: dtype {info.code} is not an FP8 weight or a float scale")
    return np.frombuffer(raw, info.dtype).reshape(info.shape).astype(np.float32)


def dequantize(w: np.ndarray, scale: np.ndarray, suffix: str, name: str) -> np.ndarray:
    """fp32 [out, in] from FP8 values (as fp32) and their scale, in transformers' arithmetic."""
    rows, cols = w.shape
    if suffix == FINE_GRAINED:
        if scale.ndim != 2 or rows % scale.shape[0] or cols % scale.shape[1]:
            raise CheckpointError(f"{name}: weight {list(w.shape)} is not a whole number of blocks of the scale grid "
                                  f"{list(scale.shape)}")
        bm, bn = rows // scale.shape[0], cols // scale.shape[1]
        return (w.reshape(scale.shape[0], bm, scale.shape[1], bn) * scale[:, None, :, None]).reshape(rows, cols)
    if scale.size == 1:
        return w * scale.reshape(())
    if scale.size == rows:
        return w * scale.reshape(rows, 1)
    raise CheckpointError(f"{name}: weight_scale {list(scale.shape)} is neither per tensor nor per output channel "
                          f"of the weight {list(w.shape)}")


def load_rows(root: Path, files: Sequence[Path], rows: Sequence[Row], shapes: Mapping[tuple, Any],
              num_layers: int, dtype, suffix: str, layer_map: LayerMap | None = None) -> dict[tuple, np.ndarray]:
    """{our path: [L, in, out] array in `dtype`} for the FP8 rows, one layer at a time (row r of a stack is HF
    layer `layer_map[stack][r]`, as `bridge.load_weights` maps them)."""
    where: dict[str, tuple[Path, TensorInfo]] = {}
    for file in files:
        where.update({name: (file, info) for name, info in read_header(file)[0].items()})
    fds = {file: os.open(file, os.O_RDONLY) for file in files}
    out = {}
    try:
        for row in rows:
            shape = tuple(shapes[row.path])
            arr = np.empty(shape, dtype)
            for r, layer in enumerate(stack_layers(row, layer_map, num_layers)):
                name = row.name(layer)
                scale_name = name[: -len("weight")] + suffix
                for n in (name, scale_name):
                    if n not in where:
                        raise CheckpointError(f"{root}: FP8 tensor {n} is missing (layer 0 stores {row.name(0)} as "
                                              "FP8); re-download the checkpoint")
                file, info = where[name]
                if info.code != _FP8_CODE:
                    raise CheckpointError(f"{root}: {name} in {file.name} is {info.code}, expected F8_E4M3 (layer 0 "
                                          "is FP8); re-download the checkpoint")
                w = dequantize(_read(fds[file], info), _read(fds[where[scale_name][0]], where[scale_name][1]),
                               suffix, f"{root}: {name}")
                if w.T.shape != shape[1:]:
                    raise CheckpointError(f"{root}: {name} is {list(w.shape)}, expected {list(shape[1:][::-1])} "
                                          f"for {'.'.join(row.path)}; check config.json sizes")
                arr[r] = w.T.astype(dtype)
            out[row.path] = arr
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def expert_rows(table: Sequence[Row], names: set[str], suffix: str, layer_map: LayerMap | None,
                num_layers: int) -> list[Row]:
    """The per-layer, per-expert weight rows stored as FP8 (the first layer of their stack has the scale tensor
    beside expert 0's weight)."""
    out = []
    for row in table:
        if row.axes != ("i", "e") or not row.hf.endswith(".weight") or row.transform != "transpose":
            continue
        layers = stack_layers(row, layer_map, num_layers)
        if layers and row.name(layers[0], e=0)[: -len("weight")] + suffix in names:
            out.append(row)
    return out


def expert_tensor_names(rows: Sequence[Row], layer_map: LayerMap | None, num_layers: int, num_experts: int,
                        names: set[str], suffix: str) -> list[str]:
    """Every on-disk tensor the FP8 expert rows take: weights, scales and (compressed-tensors) activation scales."""
    out = []
    for row in rows:
        for layer in stack_layers(row, layer_map, num_layers):
            for e in range(num_experts):
                stem = row.name(layer, e=e)[: -len("weight")]
                out += [n for n in (stem + "weight", stem + suffix, stem + "input_scale") if n in names]
    return out


def _grid(scale_shape: tuple[int, ...], weight_shape: tuple[int, ...], suffix: str, name: str) -> tuple[int, int]:
    """The [rows, cols] scale grid a stored scale of `scale_shape` lays over a weight [out, in]: fine-grained
    blocks as stored, a compressed-tensors scale per channel as [out, 1], per tensor as [1, 1]."""
    rows, cols = weight_shape
    if suffix == FINE_GRAINED:
        if len(scale_shape) == 2 and scale_shape[0] and scale_shape[1] and not rows % scale_shape[0] \
                and not cols % scale_shape[1]:
            return tuple(scale_shape)
        raise CheckpointError(f"{name}: weight {list(weight_shape)} is not a whole number of blocks of the scale "
                              f"grid {list(scale_shape)}")
    size = int(np.prod(scale_shape))
    if size in (1, rows):
        return (size, 1)
    raise CheckpointError(f"{name}: weight_scale {list(scale_shape)} is neither per tensor nor per output channel of "
                          f"the weight {list(weight_shape)}")


def expert_blocks(root: Path, files: Sequence[Path], rows: Sequence[Row], layer_map: LayerMap | None,
                  num_layers: int, suffix: str) -> dict[tuple, tuple[int, int]]:
    """{our path: (bm, bn)}: the block of each FP8 expert stack's scales, from the headers of its first layer's
    expert 0 (what `load_expert_rows` will read; for building the model's shapes before the weights)."""
    infos = {name: info for file in files for name, info in read_header(file)[0].items()}
    out = {}
    for row in rows:
        name = row.name(stack_layers(row, layer_map, num_layers)[0], e=0)
        weight, scale = infos[name], infos[name[: -len("weight")] + suffix]
        grid = _grid(scale.shape, weight.shape, suffix, f"{root}: {name}")
        out[row.path] = (weight.shape[0] // grid[0], weight.shape[1] // grid[1])
    return out


def load_expert_rows(root: Path, files: Sequence[Path], rows: Sequence[Row], shapes: Mapping[tuple, Any],
                     layer_map: LayerMap | None, num_layers: int, num_experts: int, suffix: str
                     ) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
    """{our path: (codes [L, E, out, in] float8_e4m3fn, scales [L, E, out / bm, in / bn] float32)} for the FP8
    expert rows, as stored (`shapes`: our [L, E, in, out] per path); the n parts of a fused weight fill `out` in
    order. Every expert of a stack must share one scale grid."""
    where: dict[str, tuple[Path, TensorInfo]] = {}
    for file in files:
        where.update({name: (file, info) for name, info in read_header(file)[0].items()})
    by_path: dict[tuple, list[Row]] = {}
    for row in rows:
        by_path.setdefault(row.path, []).append(row)
    fds = {file: os.open(file, os.O_RDONLY) for file in files}
    out = {}
    try:
        for path, parts in by_path.items():
            layers_n, experts, in_f, out_f = tuple(shapes[path])
            n = len(parts)
            width = out_f // n
            codes = np.empty((layers_n, experts, out_f, in_f), ml_dtypes.float8_e4m3fn)
            scales, grid = None, None
            for row in parts:
                k = row.part[0] if row.part else 0
                for r, layer in enumerate(stack_layers(row, layer_map, num_layers)):
                    for e in range(experts):
                        name = row.name(layer, e=e)
                        scale_name = name[: -len("weight")] + suffix
                        for t in (name, scale_name):
                            if t not in where:
                                raise CheckpointError(f"{root}: FP8 tensor {t} is missing (the first layer stores "
                                                      f"{row.hf} as FP8); re-download the checkpoint")
                        file, info = where[name]
                        if info.code != _FP8_CODE or tuple(info.shape) != (width, in_f):
                            raise CheckpointError(f"{root}: {name} in {file.name} is {info.code} {list(info.shape)}, "
                                                  f"expected F8_E4M3 {[width, in_f]} for {'.'.join(path)}; check "
                                                  "config.json sizes or re-download the checkpoint")
                        scale_info = where[scale_name][1]
                        g = _grid(scale_info.shape, info.shape, suffix, f"{root}: {name}")
                        if grid is None:
                            grid = g
                            scales = np.empty((layers_n, experts, n * g[0], g[1]), np.float32)
                        elif g != grid:
                            raise CheckpointError(f"{root}: {scale_name} is a {list(g)} scale grid where the other "
                                                  f"experts of {'.'.join(path)} have {list(grid)}; jaxft keeps one "
                                                  "block size per expert stack")
                        raw = os.pread(fds[file], info.nbytes, info.start)
                        if len(raw) != info.nbytes:
                            raise CheckpointError(f"{name}: file truncated")
                        codes[r, e, k * width:(k + 1) * width] = np.frombuffer(raw, ml_dtypes.float8_e4m3fn
                                                                               ).reshape(info.shape)
                        scales[r, e, k * g[0]:(k + 1) * g[0]] = _read(fds[where[scale_name][0]], scale_info
                                                                      ).reshape(g)
            out[path] = (codes, scales)
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def dequantize_experts(codes: np.ndarray, scales: np.ndarray, dtype) -> np.ndarray:
    """Our [L, E, in, out] in `dtype` from `load_expert_rows`' codes and scales, one layer at a time in float32
    (transformers' arithmetic, as `dequantize`)."""
    layers_n, experts, rows, cols = codes.shape
    grid_rows, grid_cols = scales.shape[-2:]
    out = np.empty((layers_n, experts, cols, rows), dtype)
    for layer in range(layers_n):
        w = codes[layer].astype(np.float32).reshape(experts, grid_rows, rows // grid_rows, grid_cols, cols // grid_cols)
        w = w * scales[layer][:, :, None, :, None]
        out[layer] = np.swapaxes(w.reshape(experts, rows, cols), 1, 2).astype(dtype)
    return out
