"""Where every array of a run lives: the device mesh, logical axis names -> mesh axes, and placement.

Mesh. `MeshConfig(data=D, fsdp=F, tensor=T)` (the `mesh:` key of a training config; -1 = the rest of the
devices) is a 3-D device mesh with axes ("data", "fsdp", "tensor"), D * F * T = the number of devices.
    data    batch rows split, everything else replicated (pure data parallelism)
    fsdp    batch rows split AND the frozen weights split along their large dimension (ZeRO-3 style: XLA
            all-gathers each layer's weights where the layer runs and reduce-scatters nothing, since the frozen
            weights get no gradient; the LoRA gradients are all-reduced over (data, fsdp))
    tensor  the big matmuls' output (column) / input (row) dimension split, rows NOT split (Megatron style)
Batches are split over (data, fsdp): a step consumes per_device_train_batch_size x accumulation x D x F rows.

Logical axes. Every parameter declares, where it is created, a name per dimension (`LOGICAL_AXES`, stored
as the Variable metadata "logical_axes"; `logical(...)` builds it): "layers" (the stack axis), "embed",
"mlp", "heads", "kv_heads", "vocab", "experts", "norm", "lora_rank". `RULES` is the one table that maps
them to mesh axes. A dimension stays whole when its rule names no mesh axis, when the mesh axis has size 1,
when that mesh axis already splits another dimension of the array, or when the dimension is not divisible
by the axis size (so any model shape is placeable on any mesh; the tiny test models are divisible).
Variables of the types in `ShardingRules.replicated` (the LoRA factors, scales and ranks by default: they
are small and every device needs all of them) are kept whole on every device whatever their names, and the
optimizer state follows the LoRA state it mirrors.

Collectives are left to XLA: the jitted step gets these shardings as its in/out shardings and the SPMD
partitioner inserts the all-gathers (per layer, inside the layer loop) and all-reduces. Nothing here calls
psum.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxft.errors import ConfigError
from jaxft.mesh_axes import BATCH_AXES, MESH_AXES
from jaxft.models.layers import LOGICAL_AXES, LoraParam, LoraRank, LoraScale, logical, logical_axes


__all__ = ["BATCH_AXES", "LOGICAL_AXES", "MESH_AXES", "MeshConfig", "MeshConfigError", "Placement", "RULES",
           "ShardingRules", "logical", "logical_axes", "partition_spec"]


# ------------------------------------------------------------------------------------------------ mesh config


class MeshConfigError(ConfigError):
    """A bad `mesh` setting; `field` is "mesh" (the config key) and `problem` the message without it."""

    def __init__(self, problem: str):
        self.field, self.problem = "mesh", problem
        super().__init__(f"key 'mesh': {problem}")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Devices per mesh axis; one of them may be -1 (= the devices the others leave). Default: every device
    on "data" (plain data parallelism: weights replicated, rows split)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    # `mesh: auto`: the first of `candidates` whose step fits the device memory (`jaxft.run.Run.choose_mesh`)
    auto: bool = False

    def __post_init__(self):
        if self.auto and (self.data, self.fsdp, self.tensor) != (-1, 1, 1):
            raise MeshConfigError("auto chooses the axis sizes itself; write mesh: auto or give the sizes")
        for axis in MESH_AXES:
            n = getattr(self, axis)
            if isinstance(n, bool) or not isinstance(n, int) or (n < 1 and n != -1):
                raise MeshConfigError(f"{axis}={n!r} must be a positive integer or -1 (the rest of the devices), "
                                      "e.g. mesh: {data: 2, fsdp: -1}")
        if sum(getattr(self, a) == -1 for a in MESH_AXES) > 1:
            raise MeshConfigError(f"{self.describe()} has more than one -1; give the size of all axes but one")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> "MeshConfig":
        """From the `mesh:` mapping of a config (None: the default); unknown axis names are refused."""
        if values is None:
            return cls()
        if isinstance(values, MeshConfig):
            return values
        if values == "auto":
            return cls(auto=True)
        if not isinstance(values, Mapping):
            raise MeshConfigError(f"value {values!r} must be auto or a mapping such as {{data: 2, fsdp: 4, tensor: 1}}")
        for key in values:
            if key not in MESH_AXES:
                close = difflib.get_close_matches(str(key), MESH_AXES, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise MeshConfigError(f"unknown mesh axis {key!r}{hint} (axes: {', '.join(MESH_AXES)})")
        return cls(**dict(values))

    def describe(self) -> str:
        if self.auto:
            return "auto"
        return "{" + ", ".join(f"{a}: {getattr(self, a)}" for a in MESH_AXES) + "}"

    def candidates(self, num_devices: int) -> list["MeshConfig"]:
        """`mesh: auto`'s meshes in order of communication: pure data parallelism first (weights replicated:
        one gradient all-reduce per step), then ever more of the devices on fsdp (weights split: each layer's
        weights all-gathered where it runs, forward and backward). A given mesh is its own only candidate."""
        if not self.auto:
            return [self]
        return [MeshConfig(data=num_devices // f, fsdp=f) for f in range(1, num_devices + 1) if num_devices % f == 0]

    def shape(self, num_devices: int) -> dict[str, int]:
        """{axis: size} for `num_devices` devices (-1 resolved); the product must be `num_devices`. `auto`: the
        first candidate's (until `Run.choose_mesh` picks one)."""
        if self.auto:
            return self.candidates(num_devices)[0].shape(num_devices)
        sizes = {a: getattr(self, a) for a in MESH_AXES}
        known = math.prod(n for n in sizes.values() if n != -1)
        rest = [a for a, n in sizes.items() if n == -1]
        if rest:
            if num_devices % known:
                raise MeshConfigError(f"{self.describe()}: {num_devices} devices are not a multiple of "
                                      f"{known}; give axis sizes whose product divides the device count")
            sizes[rest[0]] = num_devices // known
        if math.prod(sizes.values()) != num_devices:
            raise MeshConfigError(f"{self.describe()} needs {math.prod(sizes.values())} devices but there are "
                                  f"{num_devices}; make data x fsdp x tensor = {num_devices} (or set one axis to -1)")
        return sizes

    def make_mesh(self, devices=None) -> jax.sharding.Mesh:
        devices = list(jax.devices() if devices is None else devices)
        sizes = self.shape(len(devices))
        return jax.sharding.Mesh(np.array(devices).reshape([sizes[a] for a in MESH_AXES]), MESH_AXES)


# ------------------------------------------------------------------------------------------------ logical axes


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis -> mesh axis (or None), and the Variable types kept whole on every device."""

    axes: Mapping[str, str | None]
    replicated: tuple[type, ...] = (LoraParam, LoraScale, LoraRank)

    def __post_init__(self):
        for name, axis in self.axes.items():
            if name not in LOGICAL_AXES or (axis is not None and axis not in MESH_AXES):
                raise ValueError(f"ShardingRules: {name!r} -> {axis!r}: logical axes are {LOGICAL_AXES}, mesh axes "
                                 f"{MESH_AXES}")


# THE rules table. Frozen weights: the hidden ("embed") dimension on fsdp, the other large dimension of the big
# matmuls (MLP width, heads, vocab) on tensor; stack, norm and expert axes whole; a 4-bit weight's flat codes and
# block scales on fsdp (`Quant4bit`: gathered, one layer at a time, before they are decoded).
RULES = ShardingRules(axes={
    "layers": None, "embed": "fsdp", "mlp": "tensor", "heads": "tensor", "kv_heads": "tensor", "vocab": "tensor",
    "experts": None, "norm": None, "lora_rank": None, "quant_bytes": "fsdp",
})


def partition_spec(shape: tuple[int, ...], names: tuple[str | None, ...] | None, mesh: jax.sharding.Mesh,
                   rules: ShardingRules = RULES) -> jax.sharding.PartitionSpec:
    """The PartitionSpec of an array of `shape` whose dimensions have logical `names` (see the module doc)."""
    if not names:
        return jax.sharding.PartitionSpec()
    if len(names) != len(shape):
        raise ValueError(f"logical axes {names} do not match an array of shape {shape}")
    used, spec = set(), []
    for dim, name in zip(shape, names):
        axis = rules.axes.get(name) if name is not None else None
        size = mesh.shape[axis] if axis is not None else 1
        if axis is None or size == 1 or axis in used or dim % size:
            spec.append(None)
        else:
            used.add(axis)
            spec.append(axis)
    return jax.sharding.PartitionSpec(*spec)


# ------------------------------------------------------------------------------------------------ placement


class Placement:
    """Puts a run's state and batches on a mesh by the rules: `place(state)`, `abstract(state)` (shapes with
    shardings, for compiling before the weights exist), `batch(host_batch)`, `shardings(state)`.

    Works on `nnx.State`s whose Variables carry logical axes; a Variable holding a tuple of per-layer arrays
    (`jaxft.train.unstack_layers`) is placed element-wise with its leading ("layers") name dropped."""

    def __init__(self, mesh_config: MeshConfig | None = None, devices=None, rules: ShardingRules = RULES):
        self.config = mesh_config or MeshConfig()
        self.rules = rules
        self.devices = list(jax.devices() if devices is None else devices)
        self.mesh = self.config.make_mesh(self.devices)

    # ---- shardings
    @property
    def batch_parallel(self) -> int:
        """How many ways batch rows are split: data x fsdp."""
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    def named(self, *spec) -> jax.sharding.NamedSharding:
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(*spec))

    @property
    def replicated(self) -> jax.sharding.NamedSharding:
        return self.named()

    def sharding_of(self, var: nnx.Variable) -> jax.sharding.NamedSharding:
        """Where the rules put the array of `var` (by its logical axes and type)."""
        return self._var_sharding(var)

    def _var_sharding(self, var: nnx.Variable):
        value = var.get_value()
        names = None if isinstance(var, self.rules.replicated) else logical_axes(var)
        if isinstance(value, tuple):  # per-layer buffers: the stack axis is gone
            sub = None if names is None else names[1:]
            return tuple(self._sharding_for(tuple(v.shape), sub) for v in value)
        return self._sharding_for(tuple(value.shape), names)

    def _sharding_for(self, shape, names) -> jax.sharding.NamedSharding:
        return jax.sharding.NamedSharding(self.mesh, partition_spec(shape, names, self.mesh, self.rules))

    def shardings(self, state: nnx.State) -> nnx.State:
        """A tree like `state` with a NamedSharding in place of every array."""
        flat = [(p, v.replace(self._var_sharding(v))) for p, v in nnx.to_flat_state(state)]
        return nnx.from_flat_state(flat)

    def place(self, state: nnx.State) -> nnx.State:
        return jax.device_put(state, self.shardings(state))

    def abstract(self, state: nnx.State) -> nnx.State:
        """Shapes/dtypes of `state` (arrays or ShapeDtypeStructs) with their shardings."""
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                            self.shardings(state))

    def like(self, tree, template: nnx.State, template_shardings: nnx.State):
        """Shardings for `tree` (an optimizer state): every subtree shaped like `template` (Adam's mu, nu, ...)
        is sharded like it, every other leaf (step counts) replicated."""
        structure = jax.tree.structure(template)
        is_template = lambda x: isinstance(x, nnx.State) and jax.tree.structure(x) == structure  # noqa: E731
        return jax.tree.map(lambda x: template_shardings if is_template(x) else self.replicated, tree,
                            is_leaf=is_template)

    def place_like(self, tree, template: nnx.State):
        return jax.device_put(tree, self.like(tree, template, self.shardings(template)))

    def tracing(self):
        """The context to trace a step in: `constrain_rows` then knows the mesh."""
        return jax.set_mesh(self.mesh)

    # ---- batches
    # A step's global batch is [A, B, T] (A micro-batches of B rows) with B split into data x fsdp row shards,
    # shard s = rows s*B/(D*F) .. of every micro-batch, held by the devices at mesh position (d, f, *) with
    # s = d*F + f. A process feeds only the rows of the shards its devices hold (`local_rows`), in the order
    # (micro-batch, shard, row); with one process that is the whole batch in order.
    def batch_sharding(self, ndim: int) -> jax.sharding.NamedSharding:
        """Rows (axis 1 of [A, B, T], axis 0 of [B, T]) split over (data, fsdp)."""
        return self.named(*((None, BATCH_AXES) if ndim == 3 else (BATCH_AXES,)))

    def row_shards(self, process: int | None = None) -> list[int]:
        """The batch-row shards (0 .. data x fsdp - 1) held by devices of `process` (default: this process)."""
        process = jax.process_index() if process is None else process
        fsdp = self.mesh.shape["fsdp"]
        return sorted({d * fsdp + f for (d, f, _), dev in np.ndenumerate(self.mesh.devices)
                       if dev.process_index == process})

    def _local_fraction(self) -> tuple[list[int], int]:
        """(this process's row shards, data x fsdp); every process must hold as many shards (or its share of the
        global batch would differ from the others')."""
        counts = {p: len(self.row_shards(p)) for p in {d.process_index for d in self.mesh.devices.flat}}
        if len(set(counts.values())) > 1:
            raise MeshConfigError(f"{self.config.describe()}: the processes hold different numbers of batch-row "
                                  f"shards ({counts}); give every process the same number of devices")
        return self.row_shards(), self.batch_parallel

    def local_rows(self, num_rows: int, accumulation: int = 1) -> np.ndarray:
        """The positions in a global batch of `num_rows` rows ([A*B]: micro-batch a = rows a*B ..) that this
        process feeds, in the order `batch` expects them."""
        shards, parallel = self._local_fraction()
        if num_rows % (accumulation * parallel):
            raise ValueError(f"a batch of {num_rows} rows does not split into {accumulation} micro-batches of "
                             f"{parallel} row shards")
        per_micro = num_rows // accumulation
        size = per_micro // parallel
        return np.array([a * per_micro + s * size + j for a in range(accumulation) for s in shards
                         for j in range(size)], dtype=np.int64)

    def global_batch_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The global shape of a batch array of which this process holds `local_shape` (its `local_rows`)."""
        shards, parallel = self._local_fraction()
        axis = 1 if len(local_shape) == 3 else 0
        if local_shape[axis] % len(shards):
            raise ValueError(f"a local batch of {local_shape[axis]} rows does not split over this process's "
                             f"{len(shards)} row shards")
        shape = list(local_shape)
        shape[axis] = local_shape[axis] // len(shards) * parallel
        return tuple(shape)

    def batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows (`local_rows` order; one process: the whole batch) -> global device arrays."""
        return {k: self._global_batch_array(np.asarray(v)) for k, v in batch.items()}

    def _global_batch_array(self, local: np.ndarray) -> jax.Array:
        shards, _ = self._local_fraction()
        shape = self.global_batch_shape(local.shape)
        axis = 1 if local.ndim == 3 else 0
        size = local.shape[axis] // len(shards)  # rows per shard
        where = {s: i * size for i, s in enumerate(shards)}

        def rows_of(index):  # a device's global index -> the same block of `local`
            rows = index[axis]
            start = rows.start or 0
            stop = shape[axis] if rows.stop is None else rows.stop
            at = where[start // size] + start % size
            out = list(index)
            out[axis] = slice(at, at + stop - start)
            return local[tuple(out)]
        return jax.make_array_from_callback(shape, self.batch_sharding(local.ndim), rows_of)

    def abstract_batch(self, batch: dict[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
        """Global shapes (with their shardings) of the device batch made from this process's `batch`."""
        return {k: jax.ShapeDtypeStruct(self.global_batch_shape(tuple(v.shape)),
                                        jax.dtypes.canonicalize_dtype(v.dtype),
                                        sharding=self.batch_sharding(len(v.shape))) for k, v in batch.items()}
