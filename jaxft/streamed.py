"""The layer stacks' frozen weights packed for streaming (`ExecutionConfig.frozen_weights: host`): one pinned-host
buffer per stack and dtype, [L, total], whose row l is every streamed weight of layer l laid end to end.

Why packed: each layer's weights then reach the device in ONE copy per layer and direction. Streamed leaf by leaf
(one copy per weight), XLA runs the copies one after another and waits for most of them before the layer's first
matmul; one copy per layer runs under all of the layer's matmuls.

In the frozen state each streamed entry's value is a `PackedSlot`: the buffer (a pytree child, so the step receives
it as an argument: every slot of one buffer passes the same array) and where the entry sits in each row (static).
`jaxft.models.stack.run_groups` fetches one row per buffer and iteration (`jaxft.offload_scan.HostRows`) and slices
the layer's weights out of the row on the device (`jaxft.offload_scan.unpack_rows`). `pack` / `unpack` convert a
frozen state both ways on the host (numpy): generation and exports get ordinary arrays back (`jaxft.run.Run.model`).
Packing holds the weights twice in host memory for a moment (the numpy buffer and its pinned copy).

A linear 4-bit in some layers only (`jaxft.models.layers.Linear.quant_rows`) has fewer rows than the stack in each
format: its variables stay arrays of their own in pinned host memory, streamed one row per layer of their format
(`jaxft.models.stack.run_rows`), since a row of a packed buffer holds every layer's entries at the same offsets.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxft.models.stack import streamed_weight
from jaxft.offload_scan import PackedSlot, in_host_memory, is_slot


def _layout(frozen: nnx.State) -> tuple[dict[tuple, list[tuple[tuple, Any]]], dict[tuple, int], dict[str, int],
                                        list[tuple[tuple, Any]]]:
    """({buffer key: [(path, value), ...] in state order}, {buffer key: row length}, {stack: its layer count},
    [(path, value)] of the streamed entries with fewer rows than their stack: a mixed linear's, kept unpacked)."""
    layers: dict[str, int] = {}
    streamed = []
    for path, var in nnx.to_flat_state(frozen):
        value = var.get_value()
        if path and hasattr(value, "shape") and len(value.shape) and not isinstance(value, tuple):
            layers[path[0]] = max(layers.get(path[0], 0), value.shape[0])  # the norms have every layer's row
        if streamed_weight(path, var):
            streamed.append((path, value))
    groups: dict[tuple, list] = {}
    apart = []
    for path, value in streamed:
        if value.shape[0] != layers[path[0]]:
            apart.append((path, value))
        else:
            groups.setdefault((path[0], np.dtype(value.dtype).name), []).append((path, value))
    totals = {key: sum(math.prod(v.shape[1:]) for _, v in entries) for key, entries in groups.items()}
    return groups, totals, layers, apart


def buffer_bytes(frozen: nnx.State) -> dict[tuple[str, str], int]:
    """{(stack, dtype): bytes} of the pinned host memory `pack` would fill from `frozen` (arrays or shapes): the
    buffers, and a mixed linear's unpacked entries under their stack and dtype."""
    groups, totals, layers, apart = _layout(frozen)
    out = {key: layers[key[0]] * totals[key] * np.dtype(entries[0][1].dtype).itemsize
           for key, entries in groups.items()}
    for path, value in apart:
        key = (path[0], np.dtype(value.dtype).name)
        out[key] = out.get(key, 0) + math.prod(value.shape) * np.dtype(value.dtype).itemsize
    return out


def pack(frozen: nnx.State, sharding: jax.sharding.Sharding | None = None, *, delete_source: bool = False) -> nnx.State:
    """`frozen` with its streamed entries (`streamed_weight`) packed into one [L, total] buffer per stack and dtype,
    each entry's value a `PackedSlot` into it. Arrays are packed on the host (numpy) and placed with `sharding`
    (pinned host memory: the caller's); ShapeDtypeStructs (an abstract state) give ShapeDtypeStruct buffers.
    `delete_source` frees each device array once copied to the host."""
    groups, totals, stack_layers, apart = _layout(frozen)
    slots: dict[tuple, Any] = {}
    for key, entries in groups.items():
        layers = stack_layers[key[0]]
        abstract = isinstance(entries[0][1], jax.ShapeDtypeStruct)
        if abstract:
            rows = jax.ShapeDtypeStruct((layers, totals[key]), entries[0][1].dtype, sharding=sharding)
        else:
            host = np.empty((layers, totals[key]), dtype=np.dtype(entries[0][1].dtype))
        offset = 0
        for path, value in entries:
            size = math.prod(value.shape[1:])
            if not abstract:
                host[:, offset:offset + size] = np.asarray(value).reshape(layers, size)
                if delete_source and isinstance(value, jax.Array):
                    value.delete()
            slots[path] = (offset, tuple(value.shape[1:]))
            offset += size
        if not abstract:
            rows = jax.device_put(host, sharding) if sharding is not None else host
            del host
        for path, _ in entries:
            slots[path] = PackedSlot(rows, key, *slots[path])
    for path, value in apart:
        if isinstance(value, jax.ShapeDtypeStruct):
            slots[path] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
        elif sharding is not None:
            slots[path] = jax.device_put(np.asarray(value), sharding)
            if delete_source and isinstance(value, jax.Array):
                value.delete()
    return nnx.from_flat_state([(p, v.replace(slots[p])) if p in slots else (p, v)
                                for p, v in nnx.to_flat_state(frozen)])


def unpack(frozen: nnx.State) -> nnx.State:
    """The inverse of `pack`: every `PackedSlot` replaced by its [L, *shape] host (numpy) array, and a mixed
    linear's pinned-host entries by numpy copies."""
    host: dict[int, np.ndarray] = {}
    out = []
    for path, var in nnx.to_flat_state(frozen):
        slot = var.get_value()
        if is_slot(slot):
            rows = host.setdefault(id(slot.rows), np.asarray(slot.rows))
            var = var.replace(rows[:, slot.offset:slot.offset + slot.size].reshape(rows.shape[0], *slot.shape))
        elif streamed_weight(path, var) and in_host_memory(slot):  # a mixed linear's entry, kept unpacked
            var = var.replace(np.asarray(slot))
        out.append((path, var))
    return nnx.from_flat_state(out)


def is_packed(frozen: nnx.State) -> bool:
    return any(is_slot(v.get_value()) for _, v in nnx.to_flat_state(frozen))
