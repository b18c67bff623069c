"""Raw safetensors reading and writing with bounded host memory.

File layout (little endian)::

    [u64 n][n bytes JSON header, space padded][data]
    header = {"__metadata__": {str: str}?, name: {"dtype": "BF16", "shape": [..],
              "data_offsets": [begin, end]}, ...}   # offsets relative to data start

Why not ``safe_open(..., framework="numpy").get_tensor``: its numpy
conversion has no bfloat16 (safetensors 0.8 raises ``TypeError: data type
'bfloat16' not understood`` for BF16 tensors) and it returns a fresh copy per
tensor. We still open every file with ``safe_open`` first, so a file is
accepted exactly when the reference implementation accepts it, then read the
tensor bytes ourselves at the header offsets, straight into the caller's
destination arrays (see ``read_into``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from bridge.errors import CheckpointError

# safetensors dtype code <-> numpy dtype. BF16 comes from ml_dtypes (numpy has none).
CODE_TO_DTYPE: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_TO_CODE: dict[np.dtype, str] = {v: k for k, v in CODE_TO_DTYPE.items()}

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # same cap as the reference implementation
_T_BLOCK_ROWS = 16  # measured best of 4..64 for 2-byte and 4-byte outputs
_CORRUPT_FIX = "the file is truncated or corrupt: re-download or re-save it"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a safetensors file.

    ``start`` is the absolute byte offset in the file; ``dtype`` is None for
    codes we do not map (e.g. float8), which are only an error if needed.
    """

    name: str
    code: str
    dtype: np.dtype | None
    shape: tuple[int, ...]
    start: int
    nbytes: int


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Validate a safetensors file and return ``({name: TensorInfo}, metadata)``.

    Raises CheckpointError naming the file on any structural problem:
    unreadable, header length/JSON invalid, offsets inconsistent with shapes,
    or file size different from what the header describes (truncation).
    """
    path = Path(path)
    try:
        # Reference validation (header JSON, offsets contiguous, file fully covered).
        with safe_open(str(path), framework="numpy") as f:
            ref_keys = set(f.keys())
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({e}); {_CORRUPT_FIX}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e})") from None

    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors header; {_CORRUPT_FIX}")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(
                f"{path}: header length field says {n} bytes but the file has {size} bytes; {_CORRUPT_FIX}"
            )
        blob = f.read(n)
    try:
        header = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e}); {_CORRUPT_FIX}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object; {_CORRUPT_FIX}")

    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    infos: dict[str, TensorInfo] = {}
    data_end = 0
    for name, entry in header.items():
        try:
            code = entry["dtype"]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}: {entry!r}; {_CORRUPT_FIX}") from None
        dtype = CODE_TO_DTYPE.get(code)
        if begin < 0 or end < begin or any(d < 0 for d in shape):
            raise CheckpointError(f"{path}: tensor {name!r} has invalid offsets/shape {entry!r}; {_CORRUPT_FIX}")
        if dtype is not None and end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(
                f"{path}: tensor {name!r} ({code} {list(shape)}) needs {math.prod(shape) * dtype.itemsize} "
                f"bytes but its offsets span {end - begin}; {_CORRUPT_FIX}"
            )
        data_end = max(data_end, end)
        infos[name] = TensorInfo(name, code, dtype, shape, data_start + begin, end - begin)
    if data_start + data_end != size:
        what = "truncated" if data_start + data_end > size else "has trailing bytes"
        raise CheckpointError(
            f"{path}: file {what}: header describes {data_start + data_end} bytes, file has {size}; {_CORRUPT_FIX}"
        )
    if set(infos) != ref_keys:  # only possible if the two parsers disagree
        raise CheckpointError(f"{path}: tensor list differs between parsers; {_CORRUPT_FIX}")
    return infos, metadata


def _read_exact(fd: int, offset: int, out: memoryview, path: Path, name: str) -> None:
    """pread exactly len(out) bytes at offset into out (the file may change under us)."""
    done = 0
    total = len(out)
    while done < total:
        got = os.preadv(fd, [out[done:]], offset + done)
        if got <= 0:
            raise CheckpointError(
                f"{path}: hit end of file reading tensor {name!r} (file shrank while loading?); {_CORRUPT_FIX}"
            )
        done += got


def read_into(
    fd: int,
    path: Path,
    info: TensorInfo,
    dst: np.ndarray,
    transform: str | None,
    bounce: np.ndarray,
) -> None:
    """Copy tensor ``info`` from the open file ``fd`` into ``dst``.

    ``dst`` has the tree layout: ``info.shape`` (``transform=None``) or its
    2-D transpose (``"transpose"``), any float dtype. Same dtype and no transpose: the
    bytes are read straight into ``dst``. Otherwise rows of the source are
    read into ``bounce`` (a uint8 scratch buffer) a chunk at a time and
    cast/transposed into ``dst``, so the extra memory is ``bounce.nbytes``
    whatever the tensor size.
    """
    assert info.dtype is not None
    if transform is None and dst.dtype == info.dtype and dst.flags.c_contiguous:
        _read_exact(fd, info.start, memoryview(dst.reshape(-1).view(np.uint8)), path, info.name)
        return
    shape = info.shape or (1,)
    dst = dst.reshape(shape) if transform is None else dst
    rows = shape[0]
    row_bytes = math.prod(shape[1:]) * info.dtype.itemsize
    step = max(1, bounce.nbytes // max(row_bytes, 1))
    if row_bytes > bounce.nbytes:  # a single row bigger than the scratch: rare, size it up once
        bounce = np.empty(row_bytes, np.uint8)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        buf = bounce[: (r1 - r0) * row_bytes]
        _read_exact(fd, info.start + r0 * row_bytes, memoryview(buf), path, info.name)
        chunk = buf.view(info.dtype).reshape((r1 - r0, *shape[1:]))
        if transform == "transpose":
            # HF [out, in] rows -> our [in, out] columns, a few rows at a time: a narrow
            # block keeps both sides of the strided copy in cache (~10x faster than one .T copy).
            for b0 in range(0, r1 - r0, _T_BLOCK_ROWS):
                b1 = min(r1 - r0, b0 + _T_BLOCK_ROWS)
                dst[:, r0 + b0 : r0 + b1] = chunk[b0:b1].T
        else:
            dst[r0:r1] = chunk


@dataclasses.dataclass(frozen=True)
class PendingTensor:
    """A tensor to write: declared shape/dtype plus a function producing it on demand."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def new_temp_dir(target: Path, kind: str = "tmp") -> Path:
    """A fresh hidden directory `.<target name>.<kind>-XXXX` beside `target`, with the permissions a plain mkdir
    gives (mkdtemp's 0o700 would otherwise follow the directory when it is renamed into place)."""
    d = Path(tempfile.mkdtemp(prefix=f".{target.name}.{kind}-", dir=target.parent))
    umask = os.umask(0o22)
    os.umask(umask)
    d.chmod(0o777 & ~umask)
    return d


def write_file(path: Path, tensors: Sequence[PendingTensor], metadata: dict[str, str]) -> None:
    """Write a safetensors file, producing and writing one tensor at a time.

    The header is computed from declared shapes first, so only one tensor is
    materialised in host memory at any time.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for t in tensors:
        code = DTYPE_TO_CODE.get(t.dtype)
        if code is None:
            raise ValueError(f"cannot write tensor {t.name!r} of dtype {t.dtype} to safetensors")
        header[t.name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors:
            arr = np.ascontiguousarray(t.produce())
            if arr.shape != t.shape or arr.dtype != t.dtype:
                raise AssertionError(f"{t.name}: produced {arr.dtype}{arr.shape}, declared {t.dtype}{t.shape}")
            if arr.dtype.byteorder == ">":
                arr = arr.byteswap().view(arr.dtype.newbyteorder("<"))
            f.write(memoryview(arr.reshape(-1).view(np.uint8)))
        f.flush()
        os.fsync(f.fileno())
