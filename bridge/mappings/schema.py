"""The row type of a name-mapping table and its validation.

A table is a tuple of :class:`Row`. Each row ties one Hugging Face tensor name
(a template; ``{i}`` stands for the layer index) to one path in our flat
parameter tree, plus the layout change between the two:

* ``transform="T"``: HF stores a linear weight as ``[out, in]`` (torch's
  ``y = x @ W.T``); our kernels are ``[in, out]`` (``y = x @ K``), so
  ``K = W.T`` on load and ``W = K.T`` on save.
* ``stacked=True``: HF has one tensor per layer; we keep one array with a
  leading ``L`` axis, ``ours[i] == transform(hf[i])``.

Tables are pure data, read in both directions (load and save).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterator, Literal

LAYER = "{i}"
_TRANSFORMS = (None, "T")


@dataclasses.dataclass(frozen=True)
class Row:
    """One HF tensor <-> one tree path.

    Attributes:
      hf: HF name template, e.g. ``"model.layers.{i}.self_attn.q_proj.weight"``.
      path: path tuple in our flat tree, e.g. ``("layers", "attn", "q_proj", "kernel")``.
      transform: ``"T"`` (2-D transpose) or ``None`` (identity).
      stacked: the tensor exists once per layer and is stacked on axis 0 in our tree.
    """

    hf: str
    path: tuple[str, ...]
    transform: Literal["T"] | None
    stacked: bool

    def __post_init__(self) -> None:
        if not isinstance(self.hf, str) or not self.hf:
            raise ValueError(f"Row.hf must be a non-empty str, got {self.hf!r}")
        if not isinstance(self.path, tuple) or not self.path or not all(
            isinstance(p, str) and p for p in self.path
        ):
            raise ValueError(f"Row.path must be a non-empty tuple of str, got {self.path!r} (row {self.hf!r})")
        if self.transform not in _TRANSFORMS:
            raise ValueError(f"Row.transform must be one of {_TRANSFORMS}, got {self.transform!r} (row {self.hf!r})")
        if not isinstance(self.stacked, bool):
            raise ValueError(f"Row.stacked must be a bool, got {self.stacked!r} (row {self.hf!r})")
        # A per-layer tensor needs the layer slot in its name and vice versa,
        # otherwise the name could not be produced on save / parsed on load.
        if self.stacked != (self.hf.count(LAYER) == 1):
            raise ValueError(
                f"row {self.hf!r}: stacked={self.stacked} but the template has "
                f"{self.hf.count(LAYER)} '{LAYER}' placeholders (need exactly 1 iff stacked)"
            )
        if self.hf.replace(LAYER, "").count("{") or self.hf.replace(LAYER, "").count("}"):
            raise ValueError(f"row {self.hf!r}: only the '{LAYER}' placeholder is allowed")

    def __iter__(self) -> Iterator:
        # Rows read like the 4-tuples they describe: `for hf, path, t, stacked in TABLE`.
        return iter((self.hf, self.path, self.transform, self.stacked))

    def name(self, layer: int | None = None) -> str:
        """The concrete HF name (``layer`` is required iff the row is stacked)."""
        if self.stacked:
            if layer is None:
                raise ValueError(f"row {self.hf!r} is per layer: pass the layer index")
            return self.hf.replace(LAYER, str(int(layer)))
        if layer is not None:
            raise ValueError(f"row {self.hf!r} is not per layer, got layer={layer}")
        return self.hf

    def pattern(self) -> re.Pattern[str]:
        """Regex matching concrete names of this row; group 1 is the layer index if stacked."""
        head, sep, tail = self.hf.partition(LAYER)
        body = re.escape(head) + (r"(0|[1-9][0-9]*)" + re.escape(tail) if sep else "")
        return re.compile(body)


Table = tuple[Row, ...]


def validate_table(table: Table) -> Table:
    """Check a table is a tuple of Rows with unique HF templates and unique paths."""
    if not isinstance(table, tuple) or not table:
        raise ValueError(f"a mapping table must be a non-empty tuple of Row, got {type(table).__name__}")
    seen_hf: dict[str, Row] = {}
    seen_path: dict[tuple[str, ...], Row] = {}
    for row in table:
        if not isinstance(row, Row):
            raise ValueError(f"table entries must be bridge.mappings.Row, got {row!r}")
        if row.hf in seen_hf:
            raise ValueError(f"duplicate HF name {row.hf!r} in mapping table")
        if row.path in seen_path:
            raise ValueError(f"path {row.path} mapped twice: {seen_path[row.path].hf!r} and {row.hf!r}")
        seen_hf[row.hf] = row
        seen_path[row.path] = row
    return table
