"""Flatten / unflatten nested dicts keyed by path tuples.

``flatten_tree({"a": {"b": x}}) == {("a", "b"): x}``; ``unflatten_tree`` is its
inverse. Any non-Mapping value is a leaf (arrays, ShapeDtypeStructs, NNX
variables...). Empty sub-dicts carry no leaves and are dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def flatten_tree(tree: Mapping[Any, Any]) -> dict[tuple, Any]:
    """Nested mappings -> ``{path_tuple: leaf}`` in depth-first insertion order."""
    if not isinstance(tree, Mapping):
        raise TypeError(f"flatten_tree expects a Mapping, got {type(tree).__name__}")
    out: dict[tuple, Any] = {}

    def walk(node: Mapping[Any, Any], prefix: tuple) -> None:
        for key, value in node.items():
            path = (*prefix, key)
            if isinstance(value, Mapping):
                walk(value, path)
            else:
                out[path] = value

    walk(tree, ())
    return out


def unflatten_tree(flat: Mapping[tuple, Any]) -> dict[Any, Any]:
    """``{path_tuple: leaf}`` -> nested dicts. Rejects a path that is both a leaf and a prefix."""
    root: dict[Any, Any] = {}
    for path, value in flat.items():
        if not isinstance(path, tuple) or not path:
            raise ValueError(f"unflatten_tree keys must be non-empty tuples, got {path!r}")
        node = root
        for depth, key in enumerate(path[:-1]):
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ValueError(f"path {path} goes through leaf {path[: depth + 1]}")
            node = child
        if path[-1] in node:
            kind = "subtree" if isinstance(node[path[-1]], dict) else "leaf"
            raise ValueError(f"path {path} collides with an existing {kind}")
        node[path[-1]] = value
    return root
