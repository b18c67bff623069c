"""MXFP4 expert weights in HF checkpoints (GPT-OSS's `quantization_config.quant_method: "mxfp4"`), decoded on
import.

On disk a quantised 3-D expert parameter `<name>` ([E, in, out] in the model, x @ W) is two uint8 tensors:

    <name>_blocks  [E, out, in/32, 16]   two E2M1 codes per byte: the LOW nibble is element 2j, the HIGH 2j+1
    <name>_scales  [E, out, in/32]       one E8M0 exponent per block of 32 values: factor 2^(s - 127)

    value[e, o, 32 g + 2j + h] = FP4[nibble h of blocks[e, o, g, j]] * 2^(scales[e, o, g] - 127)
    FP4 = [0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6]     (code = sign bit 3 | 3-bit magnitude)

and the model's weight is that [E, out, in] tensor transposed to [E, in, out] (transformers'
`integrations.mxfp4.convert_moe_packed_tensors`, which the tests run against this decoder). Every decoded value
is exact in fp32 and bf16 (a 2-bit mantissa times a power of two).

`encode` is the inverse for weights given as [..., rows, cols]: per block of 32 the OCP MX scale
2^(floor(log2 amax) - 2) (the largest E2M1 magnitude is 6 = 1.5 * 2^2), values divided by it, rounded to the
nearest code (saturating at 6). Tensors of exactly representable values encode losslessly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bridge.errors import CheckpointError
from bridge.mappings.schema import Row

FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
BLOCK = 32  # values per scale
BIAS = 127  # E8M0 exponent bias
BLOCKS, SCALES = "_blocks", "_scales"


def is_mxfp4(config: Mapping[str, Any]) -> bool:
    """Whether an HF config.json dict describes an MXFP4 checkpoint."""
    quant = config.get("quantization_config")
    return isinstance(quant, Mapping) and quant.get("quant_method") == "mxfp4"


def decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> fp32 [..., G * 32] (HF's row layout)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} must be [..., G, 16] and [..., G]")
    out = np.empty((*blocks.shape[:-1], BLOCK), np.float32)
    out[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    out[..., 1::2] = FP4_VALUES[blocks >> 4]
    out = np.ldexp(out, scales.astype(np.int32)[..., None] - BIAS)
    return out.reshape(*blocks.shape[:-2], -1)


def encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp [..., cols] (cols a multiple of 32) -> (blocks uint8 [..., cols/32, 16], scales uint8 [..., cols/32])."""
    w = np.asarray(w, np.float32)
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs the last axis to be a multiple of {BLOCK}, got shape {w.shape}")
    x = w.reshape(*w.shape[:-1], -1, BLOCK)
    amax = np.max(np.abs(x), axis=-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -BIAS)
    exp = np.clip(exp, -BIAS, BIAS).astype(np.int32)
    q = np.clip(np.ldexp(x, -exp[..., None]), -6.0, 6.0)
    magnitude = np.argmin(np.abs(np.abs(q)[..., None] - FP4_VALUES[:8]), axis=-1).astype(np.uint8)
    codes = magnitude | (np.signbit(q).astype(np.uint8) << 3)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exp + BIAS).astype(np.uint8)


def to_ours(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """One quantised expert parameter (blocks [E, out, in/32, 16], scales [E, out, in/32]) -> fp32 [E, in, out]."""
    return np.swapaxes(decode(blocks, scales), -1, -2)


def from_ours(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `to_ours` for w [E, in, out]: (blocks [E, out, in/32, 16], scales [E, out, in/32])."""
    return encode(np.swapaxes(np.asarray(w, np.float32), -1, -2))


def quantized_rows(table: Sequence[Row], names: set[str]) -> list[Row]:
    """The per-layer rows of `table` stored as MXFP4 in a checkpoint holding tensors `names` (layer 0 decides)."""
    return [row for row in table if row.axes == ("i",) and row.name(0) + BLOCKS in names]


def tensor_names(row: Row, num_layers: int) -> list[str]:
    """Every on-disk tensor name of an MXFP4 row: `<name>_blocks` and `<name>_scales` of each layer."""
    return [row.name(i) + suffix for i in range(num_layers) for suffix in (BLOCKS, SCALES)]


def load_rows(root: Path, files: Sequence[Path], rows: Sequence[Row], shapes: Mapping[tuple, Any],
              num_layers: int, dtype) -> dict[tuple, np.ndarray]:
    """{our path: [L, E, in, out] array in `dtype`} for the MXFP4 rows, decoded one layer at a time. `shapes`
    gives our shape of each row's path; every mismatch or missing tensor is one CheckpointError line."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            where.update({name: file for name in f.keys()})
    out = {}
    for row in rows:
        shape = tuple(shapes[row.path])
        n_in, n_out = shape[-2:]
        want = {BLOCKS: (shape[1], n_out, n_in // BLOCK, BLOCK // 2), SCALES: (shape[1], n_out, n_in // BLOCK)}
        arr = np.empty(shape, dtype)
        for layer in range(num_layers):
            parts = {}
            for suffix, expect in want.items():
                name = row.name(layer) + suffix
                if name not in where:
                    raise CheckpointError(f"{root}: MXFP4 tensor {name} is missing (layer 0 stores "
                                          f"{row.name(0)} as MXFP4); re-download the checkpoint")
                with safe_open(str(where[name]), framework="numpy") as f:
                    parts[suffix] = f.get_tensor(name)
                if parts[suffix].dtype != np.uint8 or parts[suffix].shape != expect:
                    raise CheckpointError(
                        f"{root}: {name} in {where[name].name} is {parts[suffix].dtype} {list(parts[suffix].shape)}, "
                        f"expected uint8 {list(expect)} for {'.'.join(row.path)} {list(shape)}; check config.json "
                        "(hidden_size, intermediate_size, num_local_experts)")
            arr[layer] = to_ours(parts[BLOCKS], parts[SCALES]).astype(dtype)
        out[row.path] = arr
    return out
