"""The row type of a name-mapping table and its validation.

A table is a tuple of :class:`Row`. Each row ties one Hugging Face tensor name template to one path in our
flat parameter tree, plus the named layout change between the two (``bridge.mappings.transforms``):

* placeholders: ``{i}`` is the layer index, ``{e}`` the expert index (MoE), ``{v}`` the block index of a vision
  tower (its own stack, of another depth than the decoder's). Each appears at most once; our
  array has one leading axis per placeholder, in the order ``i``, ``e``, ``v``:
  ``ours[i, e] == transform(hf[name(i=i, e=e)])``.
* ``stacked``: the row has ``{i}`` (one HF tensor per layer, stacked on axis 0 in our tree); kept as an
  explicit field so a table reads as what it means and a mismatch with the template is caught.
* ``transform``: a registered transform name (``"transpose"``, alias ``"T"``) or ``None`` (identity).
* ``part``: ``(k, n)`` when the HF tensor is the k-th of n equal blocks of our array's last axis (after the
  transform): ``ours[i, e][..., k w:(k + 1) w] == transform(hf[name(i, e)])``, w = width / n. Qwen3-MoE keeps
  each expert's gate and up projections as the two halves of one [H, 2I] weight (one grouped matmul for both),
  while its checkpoints hold them as two tensors. The n rows of one path agree on everything but ``hf`` and k.

Tables are pure data, read in both directions (load and save).

Layer stacks: a per-layer row's array is one layer stack, named by ``path[0]`` (``"layers"``). A model may
keep its layers in several stacks (Qwen3-MoE: sparse layers in ``layers``, dense ones in ``dense_layers``);
the same HF template then has one row per stack, and the caller's ``layer_map`` ({stack: HF layer indices,
in row order}) says which HF layer each row of a stack is: ``ours[r] == transform(hf[name(i=layer_map[stack][r])])``.
Without a map (or for a stack it does not name) row r is layer r.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Iterator, Mapping

from bridge.mappings import transforms

LAYER = "{i}"
EXPERT = "{e}"
VISION_BLOCK = "{v}"
AXES = ("i", "e", "v")  # the placeholders, in the order of our array's leading axes
_SLOT = re.compile(r"\{([^{}]*)\}")


@dataclasses.dataclass(frozen=True)
class Row:
    """One HF tensor template <-> one tree path.

    Attributes:
      hf: HF name template, e.g. ``"model.layers.{i}.self_attn.q_proj.weight"``.
      path: path tuple in our flat tree, e.g. ``("layers", "attn", "q_proj", "kernel")``.
      transform: a name registered in ``bridge.mappings.transforms`` (``"T"`` reads as ``"transpose"``) or None.
      stacked: the tensor exists once per layer (the template has ``{i}``).
      part: ``(k, n)``: the tensor is block k of n along our array's last axis (module docstring), or None.
    """

    hf: str
    path: tuple[str, ...]
    transform: str | None
    stacked: bool
    part: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.hf, str) or not self.hf:
            raise ValueError(f"Row.hf must be a non-empty str, got {self.hf!r}")
        if not isinstance(self.path, tuple) or not self.path or not all(
            isinstance(p, str) and p for p in self.path
        ):
            raise ValueError(f"Row.path must be a non-empty tuple of str, got {self.path!r} (row {self.hf!r})")
        try:
            object.__setattr__(self, "transform", transforms.canonical(self.transform))
        except (ValueError, TypeError) as e:
            raise ValueError(f"row {self.hf!r}: Row.transform: {e}") from None
        if not isinstance(self.stacked, bool):
            raise ValueError(f"Row.stacked must be a bool, got {self.stacked!r} (row {self.hf!r})")
        slots = _SLOT.findall(self.hf)
        bad = [s for s in slots if s not in AXES]
        if bad or self.hf.count("{") != len(slots) or self.hf.count("}") != len(slots):
            raise ValueError(f"row {self.hf!r}: only the {{i}} (layer), {{e}} (expert) and {{v}} (vision block) placeholders are allowed")
        if len(set(slots)) != len(slots):
            raise ValueError(f"row {self.hf!r}: each placeholder may appear once")
        # A per-layer tensor needs the layer slot in its name and vice versa, otherwise the name could not be
        # produced on save / parsed on load.
        if self.stacked != ("i" in slots):
            raise ValueError(
                f"row {self.hf!r}: stacked={self.stacked} but the template has "
                f"{self.hf.count(LAYER)} '{LAYER}' placeholders (need exactly 1 iff stacked)"
            )

        if self.part is not None:
            ok = (isinstance(self.part, tuple) and len(self.part) == 2 and all(isinstance(v, int) for v in self.part)
                  and 0 <= self.part[0] < self.part[1] and self.part[1] >= 2)
            if not ok:
                raise ValueError(f"row {self.hf!r}: Row.part must be None or (k, n) with 0 <= k < n and n >= 2, "
                                 f"got {self.part!r}")

    def __iter__(self) -> Iterator:
        # Rows read like the 4-tuples they describe: `for hf, path, t, stacked in TABLE`.
        return iter((self.hf, self.path, self.transform, self.stacked))

    @property
    def axes(self) -> tuple[str, ...]:
        """The row's placeholders in our axis order (``("i",)``, ``("i", "e")`` or ``()``)."""
        slots = set(_SLOT.findall(self.hf))
        return tuple(a for a in AXES if a in slots)

    def name(self, layer: int | None = None, **indices: int) -> str:
        """The concrete HF name (``layer`` is required iff the row is stacked; ``e=`` for an expert row)."""
        if layer is not None:
            indices["i"] = layer
        if set(indices) != set(self.axes):
            if self.stacked and "i" not in indices:
                raise ValueError(f"row {self.hf!r} is per layer: pass the layer index")
            if not self.stacked and "i" in indices:
                raise ValueError(f"row {self.hf!r} is not per layer, got layer={indices['i']}")
            raise ValueError(f"row {self.hf!r} needs indices {self.axes}, got {tuple(sorted(indices))}")
        out = self.hf
        for axis, value in indices.items():
            out = out.replace("{" + axis + "}", str(int(value)))
        return out

    def indices(self, sizes: Mapping[str, int]) -> Iterator[tuple[int, ...]]:
        """Every index tuple of the row's axes (``()`` once for an unindexed row), e.g. sizes={"i": L}."""
        missing = [a for a in self.axes if a not in sizes]
        if missing:
            raise ValueError(f"row {self.hf!r} needs the count of {missing} (e.g. num_layers / num_experts / num_vision_blocks)")
        return itertools.product(*(range(int(sizes[a])) for a in self.axes))

    def name_at(self, index: tuple[int, ...], layers: tuple[int, ...] | None = None) -> str:
        """The HF name of our array's element `index`; `layers` (see `stack_layers`) maps a stack row to its layer."""
        named = dict(zip(self.axes, index))
        if layers is not None and "i" in named:
            named["i"] = layers[named["i"]]
        return self.name(**named)

    def part_slice(self, width: int) -> slice:
        """The columns of our array's last axis (of ``width``) this row's tensor fills: all of them without a part."""
        if self.part is None:
            return slice(None)
        k, n = self.part
        if width % n:
            raise ValueError(f"row {self.hf!r}: our last axis ({width}) does not split into {n} equal parts")
        return slice(k * (width // n), (k + 1) * (width // n))

    @property
    def stack(self) -> str | None:
        """The layer stack a per-layer row belongs to (its path's first name), None for other rows."""
        return self.path[0] if self.stacked else None

    def pattern(self) -> re.Pattern[str]:
        """Regex matching concrete names of this row; one group per placeholder (named i / e), in template order."""
        body, pos = "", 0
        for m in _SLOT.finditer(self.hf):
            body += re.escape(self.hf[pos:m.start()]) + f"(?P<{m.group(1)}>0|[1-9][0-9]*)"
            pos = m.end()
        return re.compile(body + re.escape(self.hf[pos:]))


Table = tuple[Row, ...]
LayerMap = Mapping[str, tuple[int, ...]]  # stack name -> the HF layer index of each of its rows


def stack_layers(row: Row, layer_map: LayerMap | None, num_layers: int) -> tuple[int, ...] | None:
    """The HF layer of each row of a per-layer row's array (None for a row without layers)."""
    if not row.stacked:
        return None
    if layer_map is not None and row.stack in layer_map:
        return tuple(int(i) for i in layer_map[row.stack])
    return tuple(range(int(num_layers)))


@dataclasses.dataclass(frozen=True)
class LoraParamRow:
    """A raw (non-Linear) HF parameter that LoRA can adapt, as PEFT's `target_parameters` does (MoE experts
    stored as one 3-D tensor per layer), and the path of the adapter module jaxft keeps for it.

    ``hf``: the parameter's name template inside the transformers model (``"model.layers.{i}.mlp.experts.
    gate_up_proj"``, the name `target_parameters` entries match); ``path``: our adapter module
    (``("layers", "mlp", "gate_up_lora")``). A family lists these rows in the order the transformers module
    declares the parameters: PEFT nests one wrapper per targeted parameter in that order, which decides the
    adapter file's key names (``bridge.peft.param_wrapper_keys``)."""

    hf: str
    path: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.hf.count(LAYER) != 1 or "{" in self.hf.replace(LAYER, ""):
            raise ValueError(f"LoraParamRow {self.hf!r}: the template needs exactly one {LAYER} and no other slot")

    @property
    def module(self) -> str:
        """The owning module's name template (``"model.layers.{i}.mlp.experts"``)."""
        return self.hf.rpartition(".")[0]

    def name(self, layer: int) -> str:
        return self.hf.replace(LAYER, str(int(layer)))


def validate_table(table: Table) -> Table:
    """Check a table is a tuple of Rows with unique HF templates and unique paths (a path in n parts: one row per
    part, all n present, alike but for the name)."""
    if not isinstance(table, tuple) or not table:
        raise ValueError(f"a mapping table must be a non-empty tuple of Row, got {type(table).__name__}")
    seen_hf: dict[tuple[str, str | None], Row] = {}
    for row in table:
        if not isinstance(row, Row):
            raise ValueError(f"table entries must be bridge.mappings.Row, got {row!r}")
        if (row.hf, row.stack) in seen_hf:  # one row per HF template and layer stack
            raise ValueError(f"duplicate HF name {row.hf!r} in mapping table")
        seen_hf[(row.hf, row.stack)] = row
    for path, rows in rows_by_path(table).items():
        first = rows[0]
        if len(rows) == 1 and first.part is None:
            continue
        parts = sorted(r.part or (-1, -1) for r in rows)
        n = first.part[1] if first.part else len(rows)
        alike = all((r.transform, r.stacked, r.axes) == (first.transform, first.stacked, first.axes) for r in rows)
        if parts != [(k, n) for k in range(n)] or not alike:
            raise ValueError(f"path {path} mapped twice: {', '.join(repr(r.hf) for r in rows)} (a path in parts "
                             "needs one row per part (k, n), k = 0..n-1, with one transform and the same placeholders)")
    return table


def rows_by_path(table: Table) -> dict[tuple[str, ...], tuple[Row, ...]]:
    """{path: its rows} (one, or one per part in part order), in table order."""
    out: dict[tuple[str, ...], list[Row]] = {}
    for row in table:
        out.setdefault(row.path, []).append(row)
    return {p: tuple(sorted(rows, key=lambda r: r.part or (0, 1))) for p, rows in out.items()}
