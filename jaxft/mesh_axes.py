"""The device mesh's axis names and the batch rows on them: what the model reads while it runs (per-device blocks
over the rows, the layer inputs' row split), below the placement of a run's arrays (`jaxft.sharding`)."""

from __future__ import annotations

import math

import jax

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # batch rows are split over both


def row_axes(mesh) -> tuple[str, ...]:
    """The axes of `mesh` that split a batch's rows (`BATCH_AXES` it has, in that order); () for an empty mesh.
    What a per-device block (`jax.shard_map` over the rows: flash attention, MoE routing) splits its rows over."""
    return () if mesh.empty else tuple(a for a in BATCH_AXES if a in mesh.axis_names)


def row_split(mesh, num_rows: int) -> tuple[str, ...] | None:
    """The axes a per-device block splits `num_rows` rows over (`row_axes`), or None when it runs as one program
    as it is: no mesh, one device, or rows those axes do not divide."""
    axes = row_axes(mesh)
    if mesh.empty or mesh.size == 1 or num_rows % math.prod(mesh.shape[a] for a in axes):
        return None
    return axes


def constrain_rows(x: jax.Array) -> jax.Array:
    """`x` [B, ...] with its rows split over (data, fsdp) when traced under a mesh that has those axes
    (`Placement.tracing()`), else `x` unchanged.

    Applied to each layer's input: without it the SPMD partitioner may meet an fsdp-split weight by gathering
    the activations' rows instead (undoing the batch split and leaving partial sums to all-reduce); pinning
    the rows to (data, fsdp) makes it gather the weights, one layer at a time, inside the layer loop."""
    mesh = jax.get_abstract_mesh()
    if mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names):
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(BATCH_AXES))
