"""The layer stacks' frozen weights packed for streaming (`ExecutionConfig.frozen_weights: host`): one pinned-host
buffer per stack and dtype, [L, total], whose row l is every streamed weight of layer l laid end to end.

Why packed: each layer's weights then reach the device in ONE copy per layer and direction. Streamed leaf by leaf
(one copy per weight), XLA runs the copies one after another and waits for most of them before the layer's first
matmul; one copy per layer runs under all of the layer's matmuls.

In the frozen state each streamed entry's value is a `PackedSlot`: the buffer (a pytree child, so the step receives
it as an argument: every slot of one buffer passes the same array) and where the entry sits in each row (static).
`jaxft.models.stack.run_groups` fetches one row per buffer and iteration (`jaxft.memory.scan_offload.HostRows`) and
slices the layer's weights out of the row on the device (`jaxft.memory.scan_offload.unpack_rows`). `pack` / `unpack`
convert a frozen state both ways on the host (numpy): generation and exports get ordinary arrays back
(`jaxft.run.Run.model`). Packing holds the weights twice in host memory for a moment (the numpy buffer and its pinned
copy). `reading_place`, `frozen_shardings` and `place` say where a run's frozen state is read and lives.

A linear 4-bit in some layers only (`jaxft.models.layers.Linear.quant_rows`) has fewer rows than the stack in each
format: its variables stay arrays of their own in pinned host memory, streamed one row per layer of their format
(`jaxft.models.stack.run_rows`), since a row of a packed buffer holds every layer's entries at the same offsets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxft.memory.scan_offload import PackedSlot, is_slot
from jaxft.models.stack import streamed_weight
from jaxft.memory.scan_offload import PackedSlot, in_host_memory, is_slot


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


def host_sharding(placement) -> jax.sharding.Sharding:
    """Where packed buffers live: pinned host memory, replicated over `placement`'s mesh
    (`jaxft.sharding.Placement`)."""
    return placement.replicated.with_memory_kind("pinned_host")


def frozen_shardings(placement, frozen: nnx.State, streams: bool) -> nnx.State:
    """Where each frozen array lives: `placement`'s sharding; where the weights stream (`streams`), a packed buffer
    (`PackedSlot`) in pinned host memory, and before packing (a program that makes the weights) the entries that
    will be packed there too."""
    flat = []
    for p, v in nnx.to_flat_state(frozen):
        value = v.get_value()
        if is_slot(value):
            flat.append((p, v.replace(dataclasses.replace(value, rows=host_sharding(placement)))))
        elif streams and streamed_weight(p, v):
            flat.append((p, v.replace(placement.sharding_of(v).with_memory_kind("pinned_host"))))
        else:
            flat.append((p, v.replace(placement.sharding_of(v))))
    return nnx.from_flat_state(flat)


def place(placement, frozen: nnx.State, streams: bool, *, delete_source: bool = True) -> nnx.State:
    """`frozen` in its places (`frozen_shardings`), packed first where the weights stream (the packing reads each
    array to the host and, with `delete_source`, frees it)."""
    if streams and not is_packed(frozen):
        frozen = pack(frozen, host_sharding(placement), delete_source=delete_source)
    return jax.device_put(frozen, frozen_shardings(placement, frozen, streams))


def reading_place(streams: bool):
    """Where a model's checkpoint is read into: with `streams` (weights that stream, read whole: not a 4-bit base,
    quantised on the accelerator one layer at a time) the host's CPU device, so the whole model never lands on the
    accelerator before it is packed into pinned host memory; else (or with no CPU backend) the default device. A
    random init still makes them on the accelerator: XLA's CPU threefry would hold uint32 buffers of about the
    model's size on the host (`jaxft.run.Run.random_state_program`)."""
    if streams:
        try:
            return jax.default_device(jax.devices("cpu")[0])
        except RuntimeError:  # JAX_PLATFORMS without cpu
            pass
    return contextlib.nullcontext()
