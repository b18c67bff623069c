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
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from bridge.errors import CheckpointError
from bridge.mappings.schema import Row
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


def quantized_rows(table: Sequence[Row], names: set[str], suffix: str) -> list[Row]:
    """The per-layer linear weight rows stored as FP8 (layer 0 has the scale tensor beside its weight)."""
    return [row for row in table if row.axes == ("i",) and row.hf.endswith(".weight") and row.transform
            and row.name(0)[: -len("weight")] + suffix in names]


def tensor_names(rows: Sequence[Row], num_layers: int, names: set[str], suffix: str) -> list[str]:
    """Every on-disk tensor the FP8 rows take: weights, scales and (compressed-tensors) activation scales."""
    out = []
    for row in rows:
        for i in range(num_layers):
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
              num_layers: int, dtype, suffix: str) -> dict[tuple, np.ndarray]:
    """{our path: [L, in, out] array in `dtype`} for the FP8 rows, one layer at a time."""
    where: dict[str, tuple[Path, TensorInfo]] = {}
    for file in files:
        where.update({name: (file, info) for name, info in read_header(file)[0].items()})
    fds = {file: os.open(file, os.O_RDONLY) for file in files}
    out = {}
    try:
        for row in rows:
            shape = tuple(shapes[row.path])
            arr = np.empty(shape, dtype)
            for layer in range(num_layers):
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
                arr[layer] = w.T.astype(dtype)
            out[row.path] = arr
    finally:
        for fd in fds.values():
            os.close(fd)
    return out
