"""Named layout transforms between an HF tensor and our tree array, each defined in both directions.

A mapping row names its transform (``Row.transform``); the registry below is the only place that says what
a name does. ``load`` turns one HF tensor into our layout, ``save`` is its exact inverse (a round trip is
byte-identical), ``hf_shape`` gives the HF shape of one of our (per-layer, per-expert) arrays so that
shapes are checked from headers before any data is read.

* ``transpose`` (alias ``T``): torch's Linear stores ``[out, in]`` (``y = x @ W.T``); our kernels are
  ``[in, out]`` (``y = x @ K``), so ``K = W.T`` and ``W = K.T``.

To add one (e.g. a head reshape for a fused projection), add a ``Transform`` to ``TRANSFORMS``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Transform:
    name: str
    hf_shape: Callable[[tuple[int, ...]], tuple[int, ...]]  # our shape -> HF shape (ValueError if impossible)
    load: Callable[[np.ndarray], np.ndarray]  # HF tensor -> our layout
    save: Callable[[np.ndarray], np.ndarray]  # our layout -> HF tensor


def _transposed_shape(ours: tuple[int, ...]) -> tuple[int, ...]:
    if len(ours) != 2:
        raise ValueError(f"the 'transpose' transform needs a 2-D tensor, got shape {ours}")
    return ours[::-1]


TRANSFORMS: dict[str, Transform] = {
    "transpose": Transform("transpose", _transposed_shape, lambda x: x.T, lambda x: x.T),
}
ALIASES = {"T": "transpose"}


def canonical(name: str | None) -> str | None:
    """The registered name for ``name`` (``None`` is the identity); ValueError naming the choices otherwise."""
    if name is None:
        return None
    name = ALIASES.get(name, name)
    if name not in TRANSFORMS:
        raise ValueError(f"unknown transform {name!r}; registered: {', '.join(sorted(TRANSFORMS))} (or None), "
                         "add it to bridge/mappings/transforms.py")
    return name


def hf_shape(name: str | None, ours: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(ours) if name is None else TRANSFORMS[name].hf_shape(tuple(ours))


def to_ours(name: str | None, x: np.ndarray) -> np.ndarray:
    return x if name is None else TRANSFORMS[name].load(x)


def to_hf(name: str | None, x: np.ndarray) -> np.ndarray:
    return x if name is None else TRANSFORMS[name].save(x)
