"""The layer stack as a sequence of homogeneous groups, each scanned or unrolled.

All layers' parameters live in one stacked module (a leading layer axis). A group is a maximal run of
consecutive layers of the same kind: the same sliding window, the same RoPE table ("global"/"local") and the
same MLP slot. Every layer of a group sees the same per-group context (its RoPE tables and attention
function, built from batch metadata computed once per batch by the decoder), so a group runs as one
`jax.lax.scan` over its slice of the stack (compile time independent of depth), or, when the frozen weights
are per-layer buffers (`jaxft.train.unstack_layers`), as unrolled calls. Gemma 2 alternates sliding/global
every layer (L groups of 1); Gemma 3 runs five sliding layers per global one.

Rematerialisation policies (`ExecutionConfig.remat`, `jaxft.remat`) are applied per layer here, the same way
in both loops: each layer is one `jax.checkpoint` whose policy sees the named residuals (layer input here,
the others in the block and the attention ops).

CSE barriers (`prevent_cse`): unrolled layers are separate program regions, so XLA could merge a layer's
recomputation back into its forward pass; the barriers keep remat meaning remat there (inside a scan the
forward and backward loops are separate and the barriers would only constrain fusion). On GPUs a layer whose
policy offloads goes without the outer barrier: its backward starts from the copy moved back from the host (a
side-effecting placement op XLA does not merge with the forward), so nothing can be CSE'd into the forward,
while the barrier would wrap the host-resident residual in an optimization barrier between the copy to the
host and the copy back - a pattern the scan never produces, and the one difference between the scanned
layers, whose offload XLA kept on the H200, and the unrolled ones, whose offload it did not
(docs/benchmarks.md: 13.47 GiB temp unrolled, about the no-remat temp, vs 1.30 GiB scanned).
`tests/test_remat_gpu.py` checks the compiled memory on the GPU. On the CPU JAX lowers no placement ops
(there is no host offload to keep): an offloading policy is a plain remat there and keeps its barriers, or
XLA merges the recompute back into the forward.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxft.config import ModelConfig
from jaxft.remat import LAYER_INPUT, RematPolicy


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Layers [start, end) that share a window, a RoPE kind and an MLP kind."""

    start: int
    end: int
    window: int | None
    rope: str = "global"
    mlp: str = "glu"


def layer_groups(cfg: ModelConfig, mlp: str = "glu") -> list[LayerGroup]:
    """The homogeneous runs of `cfg`'s layers, in order."""
    kinds = list(zip(cfg.layer_windows, cfg.layer_ropes))
    groups, start = [], 0
    for (window, rope), run in itertools.groupby(kinds):
        n = len(list(run))
        groups.append(LayerGroup(start, start + n, window, rope, mlp))
        start += n
    return groups


def _layer_runs(windows: tuple[int | None, ...]) -> list[tuple[int, int, int | None]]:
    """(start, end, window) runs of equal windows (the grouping by window alone)."""
    runs, start = [], 0
    for window, group in itertools.groupby(windows):
        n = len(list(group))
        runs.append((start, start + n, window))
        start += n
    return runs


def is_unstacked(layer_state: nnx.State) -> bool:
    """True when the per-layer parameters are tuples of per-layer arrays (see jaxft.train.unstack_layers)."""
    return any(isinstance(v.get_value(), tuple) for _, v in nnx.to_flat_state(layer_state))


def layer_slice(layer_state: nnx.State, i: int) -> nnx.State:
    """Layer i's parameters: element i of a per-layer tuple, or a static slice of a stacked array."""
    return nnx.from_flat_state([(p, v.replace(v.get_value()[i])) for p, v in nnx.to_flat_state(layer_state)])


def run_groups(layers: nnx.Module, x: jax.Array, groups: list[LayerGroup],
               group_ctx: Callable[[LayerGroup], dict[str, Any]], *, dropout_rng, policy: RematPolicy) -> jax.Array:
    """x through every group in order: `layer(x, group_ctx(group), rng)` per layer, scanned or unrolled, each
    layer rematerialised per `policy` (see the module docstring for the CSE barriers)."""
    graphdef, state = nnx.split(layers)
    unrolled = is_unstacked(state)
    num_layers = groups[-1].end
    for group in groups:
        ctx = dict(group_ctx(group), prevent_cse=unrolled)
        layer_fn = _layer_fn(graphdef, ctx, dropout_rng, policy=policy,
                             prevent_cse=unrolled and not (policy.offloads and _places_memory()))
        if unrolled:
            for i in range(group.start, group.end):
                x = layer_fn(x, layer_slice(state, i), i)
            continue
        run_state = state if (group.start, group.end) == (0, num_layers) else jax.tree.map(
            lambda leaf: leaf[group.start:group.end], state)
        indices = jnp.arange(group.start, group.end, dtype=jnp.int32)
        x, _ = jax.lax.scan(lambda carry, xs: (layer_fn(carry, *xs), None), x, (run_state, indices))
    return x


def _places_memory() -> bool:
    """Whether this backend lowers memory-placement ops (host offload): JAX does so on GPUs and TPUs only."""
    return jax.default_backend() in ("gpu", "tpu")


def _layer_fn(graphdef, layer_ctx, dropout_rng, *, policy: RematPolicy, prevent_cse: bool):
    """`(x, layer_state, index) -> x` for one layer, rematerialised per `policy`."""
    def layer_fn(carry, layer_state, index):
        layer = nnx.merge(graphdef, layer_state)
        carry = checkpoint_name(carry, LAYER_INPUT)  # a no-op unless the policy keeps or offloads it
        rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, index)
        return layer(carry, layer_ctx, rng)

    if not policy.checkpointed:
        return layer_fn
    return jax.checkpoint(layer_fn, policy=policy.jax_policy(), prevent_cse=prevent_cse)
