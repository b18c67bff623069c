"""bitsandbytes 4-bit checkpoints (what transformers writes for `BitsAndBytesConfig(load_in_4bit=True)`), in and out.

config.json carries `quantization_config` (quant_method "bitsandbytes", load_in_4bit, bnb_4bit_quant_type,
bnb_4bit_use_double_quant, llm_int8_skip_modules, ...). Every quantised linear `<module>` stores, besides any
float bias, these tensors in place of the float `<module>.weight`:

    <module>.weight                                  uint8 [ceil(out*in / 2), 1]   two 4-bit codes a byte, high first
    <module>.weight.absmax                           float32 [blocks], or uint8 [blocks] with double quantisation
    <module>.weight.quant_map                        float32 [16]                  the 4-bit code book
    <module>.weight.nested_absmax                    float32 [ceil(blocks / nested_blocksize)]   (double quant)
    <module>.weight.nested_quant_map                 float32 [256]                 the 8-bit code book (double quant)
    <module>.weight.quant_state.bitsandbytes__<nf4|fp4>   uint8 bytes of a JSON object: quant_type, blocksize,
                                                     dtype, shape [out, in], and nested_blocksize, nested_dtype,
                                                     nested_offset with double quantisation

This module reads and writes those tensors as `Quant4bitTensor` records (numpy, one per module); which tree
path a module is and how the record becomes model state is the caller's business (`jaxft.quant`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from bridge.errors import CheckpointError
from bridge.safetensors_io import PendingTensor, TensorInfo, read_header, read_into

__all__ = ["QUANT_STATE_PREFIX", "Quant4bitTensor", "quantization_config", "read_quantized", "tensor_names",
           "tensors_of"]

QUANT_STATE_PREFIX = "weight.quant_state.bitsandbytes__"
_PARTS = ("weight", "weight.absmax", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map")


@dataclasses.dataclass(frozen=True)
class Quant4bitTensor:
    """One linear's 4-bit weight as stored (see the module docstring); `shape` is torch's [out, in]."""

    packed: np.ndarray
    absmax: np.ndarray
    quant_map: np.ndarray
    shape: tuple[int, int]
    blocksize: int
    quant_type: str
    dtype: str
    nested_absmax: np.ndarray | None = None
    nested_quant_map: np.ndarray | None = None
    nested_offset: float | None = None
    nested_blocksize: int | None = None

    @property
    def double_quant(self) -> bool:
        return self.nested_absmax is not None

    def state_json(self) -> bytes:
        state: dict[str, Any] = dict(quant_type=self.quant_type, blocksize=self.blocksize, dtype=self.dtype,
                                     shape=list(self.shape))
        if self.double_quant:
            state.update(nested_blocksize=self.nested_blocksize, nested_dtype="float32",
                         nested_offset=float(self.nested_offset))
        return json.dumps(state).encode("utf-8")  # json.dumps' default separators, as bitsandbytes packs it


# quant_methods whose weights from_pretrained decodes to the compute dtype (bridge.mxfp4, bridge.fp8): dense here
DECODED_ON_LOAD = ("mxfp4", "fp8", "compressed-tensors")


def quantization_config(config: dict, source: str) -> dict | None:
    """config.json's bitsandbytes 4-bit `quantization_config` (None when the checkpoint is not quantised);
    other quantisation methods, and 8-bit, are refused with one line naming the key."""
    q = config.get("quantization_config")
    if q is None or (isinstance(q, dict) and q.get("quant_method") in DECODED_ON_LOAD):
        return None
    if not isinstance(q, dict) or q.get("quant_method") != "bitsandbytes":
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise CheckpointError(f"{source}: quantization_config.quant_method={method!r} is not supported; jaxft reads "
                              "bitsandbytes 4-bit checkpoints (or an unquantised one, which from_pretrained can "
                              "quantise with quantize='nf4')")
    if not (q.get("load_in_4bit") or q.get("_load_in_4bit")):
        raise CheckpointError(f"{source}: quantization_config is bitsandbytes 8-bit (load_in_4bit is not true); jaxft "
                              "reads 4-bit checkpoints only: use the unquantised model")
    return q


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32)


def read_quantized(path: str | os.PathLike, files: list[Path]) -> dict[str, Quant4bitTensor]:
    """{HF module name ("model.layers.0.self_attn.q_proj"): record} for every 4-bit weight in `files`."""
    located: dict[str, tuple[Path, TensorInfo]] = {}
    for file in files:
        infos, _ = read_header(file)
        for name, info in infos.items():
            located[name] = (file, info)
    modules = {}
    for name in located:
        head, sep, qtype = name.rpartition("." + QUANT_STATE_PREFIX)
        if sep:
            modules[head] = qtype

    def read(name: str) -> np.ndarray:
        file, info = located[name]
        if info.dtype is None:
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {info.code}, which a 4-bit weight never has")
        out = np.empty(info.shape, info.dtype)
        fd = os.open(file, os.O_RDONLY)
        try:
            read_into(fd, file, info, out, None, np.empty(1 << 20, np.uint8))
        finally:
            os.close(fd)
        return out

    records = {}
    for module, qtype in sorted(modules.items()):
        state_name = f"{module}.{QUANT_STATE_PREFIX}{qtype}"
        file = located[state_name][0]
        try:
            state = json.loads(read(state_name).tobytes().decode("utf-8"))
            shape = tuple(int(d) for d in state["shape"])
            blocksize = int(state["blocksize"])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{file}: {state_name} is not a bitsandbytes quant state ({e}); re-save the "
                                  "checkpoint with transformers") from None
        double = "nested_offset" in state
        need = _PARTS if double else _PARTS[:3]
        missing = [f"{module}.{p}" for p in need if f"{module}.{p}" not in located]
        if missing:
            raise CheckpointError(f"{file}: 4-bit weight {module} lacks {missing}; the checkpoint is incomplete")
        if len(shape) != 2:
            raise CheckpointError(f"{file}: {state_name} has shape {list(shape)}; only 2-D linear weights are 4-bit")
        packed = read(f"{module}.weight").reshape(-1)
        n = math.prod(shape)
        if packed.dtype != np.uint8 or packed.size != -(-n // 2):
            raise CheckpointError(f"{file}: {module}.weight is {packed.dtype} with {packed.size} values; a 4-bit "
                                  f"weight of shape {list(shape)} is uint8 with {-(-n // 2)} bytes")
        records[module] = Quant4bitTensor(
            packed=packed, absmax=read(f"{module}.weight.absmax").reshape(-1),
            quant_map=_f32(read(f"{module}.weight.quant_map")), shape=shape, blocksize=blocksize,
            quant_type=str(state.get("quant_type", qtype)), dtype=str(state.get("dtype", "bfloat16")),
            nested_absmax=_f32(read(f"{module}.weight.nested_absmax")).reshape(-1) if double else None,
            nested_quant_map=_f32(read(f"{module}.weight.nested_quant_map")) if double else None,
            nested_offset=float(state["nested_offset"]) if double else None,
            nested_blocksize=int(state.get("nested_blocksize", 256)) if double else None)
    return records


def tensor_names(module: str, record: Quant4bitTensor) -> list[str]:
    """The checkpoint names of one 4-bit weight."""
    parts = _PARTS if record.double_quant else _PARTS[:3]
    return [f"{module}.{p}" for p in parts] + [f"{module}.{QUANT_STATE_PREFIX}{record.quant_type}"]


def tensors_of(module: str, record: Quant4bitTensor) -> list[PendingTensor]:
    """PendingTensors writing one 4-bit weight under `module`'s names (what transformers saves)."""
    values = [record.packed.reshape(-1, 1), record.absmax, _f32(record.quant_map)]
    if record.double_quant:
        values += [_f32(record.nested_absmax), _f32(record.nested_quant_map)]
    values.append(np.frombuffer(record.state_json(), np.uint8))
    out = []
    for name, value in zip(tensor_names(module, record), values):
        value = np.ascontiguousarray(value)
        out.append(PendingTensor(name, tuple(value.shape), value.dtype, lambda v=value: v))
    return out
