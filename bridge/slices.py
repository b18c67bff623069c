"""An HF checkpoint read one slice of one tree array at a time (`WeightSlices`), for sharded loading: validated as
`bridge.hf.load_weights` validates (headers only), then each device's shard read from the files alone."""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from bridge.hf import _locate, _path_str
from bridge.mappings import transforms
from bridge.mappings.schema import LayerMap, Row, Table, rows_by_path


class WeightSlices:
    """An HF checkpoint read one slice of one tree array at a time (for sharded loading: each device's shard
    is read from the files alone, so no process holds a whole tensor it does not own).

    Opened with the same arguments as ``load_weights`` and validated the same way (headers only, every problem
    reported before any data is read). ``read(path, index)`` returns ``out[path][index]`` of what
    ``load_weights`` would return, for ``index`` a tuple of slices (what ``jax.make_array_from_callback``
    passes), reading through ``safe_open(...).get_slice``: the leading layer / expert axes select HF tensors,
    the rest select a slice of each (of its transpose for ``transpose`` rows). A row with another named
    transform reads its whole HF tensor (one at a time) and slices the result. Use as a context manager.
    """

    def __init__(self, path: str | os.PathLike, table: Table, expected: Mapping[tuple, Any], num_layers: int,
                 dtype: Any = None, *, num_experts: int | None = None, layer_map: LayerMap | None = None,
                 num_vision_blocks: int | None = None):
        from safetensors import safe_open

        self.root = Path(path)
        wants, self.specs, files, located = _locate(self.root, table, expected, num_layers, dtype, num_experts,
                                                    layer_map=layer_map, num_vision_blocks=num_vision_blocks)
        self._names = {(p, index, row.part): name for name, (p, index, row, _) in wants.items()}
        self._rows = {p: rows for p, rows in rows_by_path(table).items() if p in self.specs}
        self._file_of = {name: file for name, (file, _) in located.items()}
        self._handles = {file: safe_open(str(file), framework="numpy") for file in files}

    def __enter__(self) -> "WeightSlices":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles = {}

    def read(self, path: tuple, index: tuple = ()) -> np.ndarray:
        shape, dt = self.specs[path]
        rows = self._rows[path]
        row = rows[0]
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        lead, rest = index[:len(row.axes)], index[len(row.axes):]
        lead_ranges = [range(*sl.indices(n)) for sl, n in zip(lead, shape[:len(row.axes)])]
        rest_slices = [slice(*sl.indices(n)) for sl, n in zip(rest, shape[len(row.axes):])]
        out = np.empty([len(r) for r in lead_ranges] + [len(range(sl.start, sl.stop, sl.step or 1))
                                                           for sl in rest_slices], dt)
        for k, at in zip(itertools.product(*[range(len(r)) for r in lead_ranges]),
                         itertools.product(*lead_ranges)):
            out[k] = self._parts(path, tuple(at), rows, rest_slices).astype(dt, copy=False)
        return out

    def _parts(self, path: tuple, at: tuple, rows: tuple[Row, ...], rest: list[slice]) -> np.ndarray:
        """Our array's element `at`, sliced by `rest`: from one tensor, or from each part's tensor whose block of
        the last axis the slice touches (joined along it)."""
        if rows[0].part is None:
            return self._one(path, at, rows[0], rest)
        width, last = self.specs[path][0][-1], rest[-1]
        if last.step != 1:
            raise ValueError(f"WeightSlices.read({_path_str(path)}): a path stored in parts reads contiguous "
                             f"column slices only, got step {last.step}")
        pieces = []
        for row in rows:
            block = row.part_slice(width)
            lo, hi = max(last.start, block.start), min(last.stop, block.stop)
            if lo < hi:
                sub = slice(lo - block.start, hi - block.start, 1)
                pieces.append(self._one(path, at, row, [*rest[:-1], sub]))
        return np.concatenate(pieces, axis=-1)

    def _one(self, path: tuple, at: tuple, row: Row, rest: list[slice]) -> np.ndarray:
        name = self._names[(path, at, row.part)]
        tensor = self._handles[self._file_of[name]].get_slice(name)
        if row.transform is None:
            return tensor[tuple(rest)] if rest else np.asarray(tensor[:])
        if row.transform == "transpose":  # ours [a, b] = hf[b, a].T
            return tensor[rest[1], rest[0]].T
        return transforms.to_ours(row.transform, tensor[:])[tuple(rest)]
