"""The layer stack as a sequence of homogeneous groups, each scanned or unrolled.

The layers' parameters live in stacked modules (a leading layer axis), one per MLP kind in use
(`layer_stacks`): the layers of the family's own kind at `Decoder.layers`, and, when some layers have the
other kind (Qwen3-MoE's dense layers among sparse ones), those at `dense_layers` (or `moe_layers`). Row r of
a stack is the r-th layer of its kind. A group is a maximal run of consecutive layers of the same kind: the
same sliding window, the same RoPE table ("global"/"local") and the same MLP kind (so one stack, and a
contiguous range of its rows). Every layer of a group sees the same per-group context (its RoPE tables and attention
function, built from batch metadata computed once per batch by the decoder), so a group runs as one
`jax.lax.scan` over its slice of the stack (compile time independent of depth), or, when the frozen weights
are per-layer buffers (`jaxft.train.unstack_layers`), as unrolled calls. Gemma 2 alternates sliding/global
every layer (L groups of 1); Gemma 3 runs five sliding layers per global one. Over stacked weights such a
periodic stack is one scan whose body is one period (`layer_period`).

A linear 4-bit in some layers and dense in others (`Linear.quant_rows`: a bitsandbytes checkpoint whose
`llm_int8_skip_modules` names single layers' modules) holds each format's rows apart, so a scan body, which has
one format per linear, runs over runs of layers of one layout (`mixed_rows`, `_uniform_runs`; no periodic scan
then), and an unrolled layer reads its own row of whichever format it has (`layer_slice`). Over streamed weights
(`frozen_weights: host`) such a run reads its own rows of each mixed variable, an array of its own in host memory
(`jaxft.memory.streamed`), and the run's rows of the packed buffers.

Rematerialisation policies (`ExecutionConfig.remat`, `jaxft.memory.policy`) are applied per layer here, the same way
in both loops: each layer is one `jax.checkpoint` whose policy sees the named residuals (layer input here,
the others in the block and the attention ops).

CSE barriers (`prevent_cse`): unrolled layers are separate program regions, so XLA could merge a layer's
recomputation back into its forward pass; the barriers keep remat meaning remat there (inside a scan the
forward and backward loops are separate and the barriers would only constrain fusion). On GPUs a layer whose
policy offloads goes without the outer barrier: its backward starts from the copy moved back from the host, so
nothing can be CSE'd into the forward.

Nested checkpointing (`RematPolicy.block` > 1, `ExecutionConfig.remat_block`, layer scan only): each scan over
layers or periods becomes an outer scan over blocks of them (`_scan_layers`), each block one checkpoint keeping
its input alone, the layers inside full checkpoints; the outer policy offloads the block input for remat "offload".

Host offload of the layer input (`resolve_transfer`): in the scan, jax.checkpoint's offload policy, whose copies
XLA keeps (they go through the loop's stacked host buffer); in the unrolled loop XLA folds the policy's copy to
the host and copy back into nothing (no S(5) value is left in the compiled program), so
remat "offload" there takes the explicit transfer of `jaxft.memory.offload` (ExecutionConfig.offload_transfer), whose
copy back reads an optimization barrier. `tests/test_remat_gpu.py` checks the compiled memory on the GPU,
`experiments/probes/offload_probe.py` measures every combination. On the CPU JAX lowers no placement ops (there is no
host offload to keep): an offloading policy is a plain remat there.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxft.config import ModelConfig
from jaxft.families import family_for
from jaxft.mesh_axes import constrain_rows
from jaxft.models.layers import ExpertParam, QuantizedWeight, StackRow, linears
from jaxft.memory.offload import PrefetchChain, host_offloaded, layer_index
from jaxft.memory.scan_offload import HostRows, in_host_memory, is_slot, offloaded_scan, unpack_rows
from jaxft.memory.policy import RematPolicy
from jaxft.residuals import BLOCK_INPUT, LAYER_INPUT
from kernels_pallas._dispatch import target_platform


# The attribute of a layer stack of an MLP kind that is not its family's own (that one is `layers`).
OTHER_STACKS = {"glu": "dense_layers", "moe": "moe_layers"}
STACK_NAMES = ("layers", *OTHER_STACKS.values())


def stack_name(cfg: ModelConfig, mlp: str) -> str:
    """The decoder attribute that stacks the layers of MLP kind `mlp`."""
    return "layers" if mlp == family_for(cfg.model_type).parts.mlp else OTHER_STACKS[mlp]


def streamed_weight(path: tuple, var: nnx.Variable) -> bool:
    """Whether a frozen state entry goes to pinned host memory under `frozen_weights: host`: the stacked weight
    matrices of a layer stack ([L, in, out] and up, MoE expert stacks included) and a 4-bit base's storage
    (`QuantizedWeight`, experts' too: codes and scales, selected by type); not the stack's small rows (norms,
    biases, LoRA scales and ranks, which stay on the device), nor the embeddings and head."""
    if not path or path[0] not in STACK_NAMES:
        return False
    value = var.get_value()
    if isinstance(value, tuple) or not hasattr(value, "shape"):
        return False
    return isinstance(var, QuantizedWeight) or len(value.shape) >= 3


def layer_stacks(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{stack attribute: the layer indices it holds, in order}, `layers` first: row r of a stack is layer
    `stacks[name][r]` (what the weight tables, LoRA and the KV cache map HF layer indices through)."""
    out: dict[str, list[int]] = {"layers": []}
    for i, mlp in enumerate(cfg.layer_mlps):
        out.setdefault(stack_name(cfg, mlp), []).append(i)
    return {name: tuple(rows) for name, rows in out.items()}


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Layers [start, end) that share a window, a RoPE kind and an MLP kind; their parameters are rows
    [row, row + end - start) of the stack `stack`."""

    start: int
    end: int
    window: int | None
    rope: str = "global"
    mlp: str = "glu"
    stack: str = "layers"
    row: int | None = None  # None: `start` (a model with one stack)

    @property
    def first_row(self) -> int:
        return self.start if self.row is None else self.row


def layer_groups(cfg: ModelConfig) -> list[LayerGroup]:
    """The homogeneous runs of `cfg`'s layers, in order."""
    kinds = list(zip(cfg.layer_windows, cfg.layer_ropes, cfg.layer_mlps))
    groups, start, rows = [], 0, {}
    for (window, rope, mlp), run in itertools.groupby(kinds):
        n = len(list(run))
        stack = stack_name(cfg, mlp)
        groups.append(LayerGroup(start, start + n, window, rope, mlp, stack, rows.get(stack, 0)))
        rows[stack] = rows.get(stack, 0) + n
        start += n
    return groups


def _layer_runs(windows: tuple[Any, ...]) -> list[tuple[int, int, Any]]:
    """(start, end, window) runs of equal windows (the grouping by window alone); any values group the same way
    (a period's positions by their group's id)."""
    runs, start = [], 0
    for window, group in itertools.groupby(windows):
        n = len(list(group))
        runs.append((start, start + n, window))
        start += n
    return runs


# `_layer_fn(row=DYNAMIC_ROW)`: the layer state argument is (block, row index), the row a traced index (an inner
# scan over a run of a period's rows)
DYNAMIC_ROW = -1


def is_unstacked(layer_state: nnx.State) -> bool:
    """True when the per-layer parameters are tuples of per-layer arrays (see jaxft.train.unstack_layers)."""
    return any(isinstance(v.get_value(), tuple) for _, v in nnx.to_flat_state(layer_state))


def layer_slice(layer_state: nnx.State, i: int, mixed: dict[tuple, np.ndarray] | None = None) -> nnx.State:
    """Layer i's parameters: element i of a per-layer tuple, or a static slice of a stacked array; a mixed
    linear's variables (`mixed_rows`) give their own row of layer i, or None where it is in the other format."""
    def row(p, v):
        own = mixed.get(_key(p)) if mixed else None
        if own is None:
            return v.replace(v.get_value()[i])
        return v.replace(None if own[i] < 0 else v.get_value()[own[i]])

    return nnx.from_flat_state([(p, row(p, v)) for p, v in nnx.to_flat_state(layer_state)])


def mixed_rows(module) -> dict[tuple, np.ndarray]:
    """{state path of a variable of a linear 4-bit in some layers only (`Linear.quant_rows`): int32 [L], its own
    row for each stack row, -1 where that layer is in the other format}: the kernel holds the dense rows, `quant`
    the 4-bit ones. Empty for a stack whose linears each have one format."""
    out: dict[tuple, np.ndarray] = {}
    for path, lin in linears(module):
        if lin.quant_rows is None:
            continue
        four = np.asarray(lin.quant_rows)
        base = tuple(path.split("."))
        out[(*base, "kernel")] = np.where(~four, np.cumsum(~four) - 1, -1).astype(np.int32)
        for name in ("packed", "absmax", "nested_absmax", "offset"):
            out[(*base, "quant", name)] = np.where(four, np.cumsum(four) - 1, -1).astype(np.int32)
    return out


def _key(path: tuple) -> tuple[str, ...]:
    return tuple(str(p) for p in path)


def layout(mixed: dict[tuple, np.ndarray], row: int) -> tuple[bool, ...]:
    """Which of a stack's mixed linear variables (`mixed_rows`) stack row `row` reads: layers of one layout run
    as one scan."""
    return tuple(bool(own[row] >= 0) for own in mixed.values())


def _uniform_runs(group: LayerGroup, mixed: dict[tuple, np.ndarray]) -> list[LayerGroup]:
    """`group` cut into runs of layers whose mixed linears (`mixed_rows`) have the same format in each: a scan
    body holds one format per linear."""
    if not mixed:
        return [group]
    first, out, start = group.first_row, [], group.start
    for _, run in itertools.groupby(layout(mixed, first + k) for k in range(group.end - group.start)):
        n = len(list(run))
        out.append(dataclasses.replace(group, start=start, end=start + n, row=first + start - group.start))
        start += n
    return out


def run_rows(state: nnx.State, first: int, n: int, mixed: dict[tuple, np.ndarray], *,
             streamed: bool = False) -> nnx.State:
    """Stack rows [first, first + n) of a run of one layout (`_uniform_runs`, `layout`): a mixed linear's
    variables give their own rows of it, or None (the format the run does not use). `streamed` (frozen weights in
    host memory): the other entries stay whole (the scan reads the run's rows of them) and a mixed variable, an
    array of its own in host memory (`jaxft.memory.streamed.pack`), is read from its own first row (`HostRows`)."""
    def rows(p, v):
        own = mixed.get(_key(p))
        if own is None:
            return v if streamed else v.replace(v.get_value()[first:first + n])
        r = int(own[first])
        if r >= 0 and streamed and in_host_memory(v.get_value()):
            return v.replace(HostRows(v.get_value(), r))
        return v.replace(None if r < 0 else v.get_value()[r:r + n])

    return nnx.from_flat_state([(p, rows(p, v)) for p, v in nnx.to_flat_state(state)])


def layer_period(groups: list[LayerGroup]) -> int | None:
    """The length P of the shortest repeating pattern of layer kinds when it repeats at least twice over whole
    periods and holds more than one group (Gemma 2: P = 2; Gemma 3: P = 6), else None. A period runs as one
    scan body, so an alternating stack is still one scan over L // P steps instead of L scans of one layer
    (each of those slices the stacked weights and keeps its own copy for the backward pass)."""
    kinds = [(g.window, g.rope, g.mlp) for g in groups for _ in range(g.start, g.end)]
    n = len(kinds)
    for p in range(2, n // 2 + 1):
        if all(kinds[i] == kinds[i % p] for i in range(n)) and len(set(kinds[:p])) > 1:
            return p
    return None


def run_groups(layers, x: jax.Array, groups: list[LayerGroup],
               group_ctx: Callable[[LayerGroup], dict[str, Any]], *, dropout_rng, policy: RematPolicy,
               per_layer: Sequence[RematPolicy] | None = None, router_stats: jax.Array | None = None):
    """x through every group in order: `layer(x, group_ctx(group), rng)` per layer, scanned or unrolled, each
    layer rematerialised per `policy` (see the module docstring for the CSE barriers), or layer i per
    `per_layer[i]` (`ExecutionConfig.layer_policies`: remat_layers; unrolled layers only: a scan body
    is one policy). Stacked weights of a periodic stack scan over whole periods (`layer_period`), the rest by group.

    `layers`: the stacked layer module, or {stack name: module} (`layer_stacks`) when groups name several.
    With `router_stats` (a zero [2, E] accumulator, and "router_token_weights" in the contexts of the sparse
    groups) every sparse layer returns (x, its router's stats), which are summed in the scan carry (dense
    layers pass the accumulator through): the result is (x, stats)."""
    stacks = layers if isinstance(layers, dict) else {"layers": layers}
    split = {name: nnx.split(module) for name, module in stacks.items()}
    states = {name: state for name, (_, state) in split.items()}
    # Linears 4-bit in some layers only: each layer reads its own format's row; scans run over layers of one
    # layout (`_uniform_runs`).
    mixed = {name: mixed_rows(module) for name, module in stacks.items()}
    unrolled = any(is_unstacked(state) for state in states.values())
    num_layers = groups[-1].end
    if per_layer is not None and not unrolled:
        raise ValueError("run_groups: per-layer policies (ExecutionConfig.remat_layers) need "
                         "per-layer weight buffers (layer_loop: unroll)")
    without = RematPolicy("none")
    # Nested checkpointing (`RematPolicy.block`, jaxft.memory.policy): an outer scan over blocks of layers, each block
    # one checkpoint of policy `outer` keeping its input alone, each layer inside a full checkpoint.
    outer, block = None, policy.block if policy.checkpointed else 1
    if block > 1:
        if unrolled:
            raise ValueError("run_groups: nested remat blocks (ExecutionConfig.remat_block) need the layer scan")
        outer, policy = policy.nested()
    # The explicitly offloaded layers of an unrolled loop pass each other the signal that starts a copy back one
    # layer early (jaxft.memory.offload.PrefetchChain); this trace's own, in layer order.
    chain = PrefetchChain() if unrolled else None
    # In a scan the expert stacks stay whole, outside the scanned state: each layer reads its row in place
    # (`StackRow`). Unrolled layers have buffers of their own already.
    expert_stacks: dict[str, nnx.State | None] = {name: None for name in states}
    if not unrolled:
        for name in states:
            states[name], expert_stacks[name] = _split_expert_stacks(states[name])
    rows_of = _stack_rows(groups, num_layers)
    # Remat "offload" with the explicit transfer in a scan: one custom VJP around the whole scan
    # (`jaxft.memory.scan_offload`), whose backward copies each layer input back one layer early; the layers inside it
    # run without a checkpoint of their own (its backward recomputes them).
    scan_offload = not unrolled and resolve_transfer(policy, False) == "explicit"
    # Frozen weights in pinned host memory (`ExecutionConfig.frozen_weights: host`): the same scan, streaming each
    # layer's rows in one layer ahead (`HostRows`), the layer inputs on the host where the policy offloads them,
    # what else it keeps stacked by the scan, on the device, or on the host when it keeps nothing on the device
    # (`RematPolicy.streaming`).
    streamed = any(in_host_memory(leaf) for state in states.values() for leaf in jax.tree.leaves(state))
    keep_on_host, kept, kept_on_host = True, None, False
    if streamed:
        if unrolled or per_layer is not None or outer is not None or not policy.streams:
            raise ValueError("run_groups: frozen weights in host memory stream through the layer scan under one "
                             "policy that offloads at most the layer input or keeps nothing on the device (got "
                             f"{policy.spelled()!r}, unrolled={unrolled}, block={block})")
        scan_offload = True
        kept, keep_on_host, kept_on_host = policy.streaming()
    if scan_offload:
        policy = without

    # Full layers of a plan that also offloads go through the explicit VJP with their input kept on the device
    # (`host_offloaded(host=False)`): its barriers hold each recompute until the layer's own backward.
    ordered = per_layer is not None and any(p.offloads for p in per_layer)

    def fn_for(group, policy=policy, row=None):
        ctx = dict(group_ctx(group), prevent_cse=unrolled)
        transfer = "ordered" if ordered and policy.kind == "full" else resolve_transfer(policy, unrolled)
        fn = _layer_fn(split[group.stack][0], ctx, dropout_rng, policy=policy,
                       prevent_cse=unrolled and not (policy.offloads and _places_memory()),
                       transfer=transfer, row=row, chain=chain,
                       stacks=expert_stacks[group.stack], stack_rows=rows_of[group.stack])
        if router_stats is None:
            return fn
        return _summing_stats(fn) if "router_token_weights" in ctx else _passing_stats(fn)

    carry = x if router_stats is None else (x, router_stats)

    period = None if unrolled or any(mixed.values()) else layer_period(groups)
    if period is not None:
        kinds = [g for g in groups for _ in range(g.start, g.end)][:period]
        # Position j of the period reads row `slot[j]` of its stack's rows for the period.
        counts: dict[str, int] = {}
        slot = []
        for g in kinds:
            slot.append(counts.get(g.stack, 0))
            counts[g.stack] = counts.get(g.stack, 0) + 1
        reps = num_layers // period
        # The period's positions in runs of one kind (Gemma 3: five sliding layers, then one global; Gemma 2: runs
        # of one). A run of one position is one call; a longer run is an inner scan over its rows. Why: in the
        # backward of one period XLA may recompute every checkpointed layer of the body before it needs any, so a
        # body of six calls holds several layers' recomputed activations at once; an inner scan's backward runs its
        # layers one at a time (Gemma-3-12B at 1 x 16384 packed, full remat: temp 21.25 GiB with six calls, 13.63
        # with the inner scan). Not for policies that offload to the host: their
        # residuals would be host buffers stacked in two loops, which XLA's layout assignment rejects on JAX
        # 0.11.2 (offload+attn keeps the six calls; not solved here). Each fn
        # takes its stack's block for the period and slices its row itself, inside its checkpoint (`_layer_fn`
        # row=): see there for why.
        # (`scan_offload` keeps one call per position too: each one's input is a carry the offloaded scan keeps.)
        runs = ([(a, b) for a, b, _ in _layer_runs(tuple(map(id, kinds)))] if not (policy.offloads or scan_offload)
                else [(j, j + 1) for j in range(period)])
        fns = [fn_for(kinds[a], row=slot[a] if b - a == 1 else DYNAMIC_ROW) for a, b in runs]

        def body(carry, xs):
            period_states, base = xs
            for (a, b), fn in zip(runs, fns):
                block = period_states[kinds[a].stack]
                if b - a == 1:
                    carry = fn(carry, block, base + a)
                    continue
                rows = jnp.asarray(slot[a:b], dtype=jnp.int32)
                carry, _ = jax.lax.scan(lambda c, x, fn=fn, block=block: (fn(c, (block, x[0]), x[1]), None),
                                        carry, (rows, base + jnp.arange(a, b, dtype=jnp.int32)))
            return carry, None

        parts = {name: _scanned(states[name], lambda leaf, c=c: HostRows(leaf, 0, c),
                                lambda leaf, c=c: leaf[:reps * c].reshape(reps, c, *leaf.shape[1:]))
                 for name, c in counts.items()}
        head = {name: part for name, (part, _) in parts.items()}
        packed = {key: rows for _, buffers in parts.values() for key, rows in buffers.items()}
        bases = jnp.arange(0, reps * period, period, dtype=jnp.int32)
        if scan_offload:  # one function per position of the period, each one's input kept on the host
            carry = offloaded_scan([lambda c, xs, a=a, fn=fn: fn(c, unpack_rows(xs[0], xs[1])[kinds[a].stack],
                                                                 xs[2] + a)
                                    for (a, _), fn in zip(runs, fns)], carry, (head, packed, bases), host=keep_on_host,
                                   policy=kept, residuals_host=kept_on_host)
        else:  # nested blocks hold whole periods: as many as make up `block` layers, at least one
            carry = _scan_layers(lambda c, xs: body(c, xs)[0], carry, (head, bases), max(1, block // period), outer)
        # A last, incomplete period (e.g. 62 = 10 x 6 + 2 layers) runs by group below.
        cut = reps * period
        groups = [dataclasses.replace(g, start=max(g.start, cut), row=g.first_row + max(0, cut - g.start))
                  for g in groups if g.end > cut]
    if not unrolled:
        groups = [run for group in groups for run in _uniform_runs(group, mixed[group.stack])]
    for group in groups:
        state = states[group.stack]
        first, n = group.first_row, group.end - group.start
        if unrolled:
            fns = {}  # one layer function per policy the group's layers take
            for k in range(n):
                index = group.start + k
                own = policy if per_layer is None else per_layer[index]
                fn = fns.get(own) or fns.setdefault(own, fn_for(group, own))
                carry = fn(carry, layer_slice(state, first + k, mixed[group.stack]), index)
            continue
        layer_fn = fn_for(group)
        if mixed[group.stack] and streamed:  # packed buffers are read in place: a run reads its rows of them
            state = run_rows(state, first, n, mixed[group.stack], streamed=True)
        elif mixed[group.stack]:
            state, first = run_rows(state, first, n, mixed[group.stack]), 0
        whole = first == 0 and all(leaf.shape[0] == n for leaf in jax.tree.leaves(state, is_leaf=_host_rows)
                                   if not _host_rows(leaf))
        run_state, packed = _scanned(state, lambda leaf: HostRows(leaf, first),
                                     lambda leaf: leaf if whole else leaf[first:first + n])
        indices = jnp.arange(group.start, group.end, dtype=jnp.int32)
        if scan_offload:
            carry = offloaded_scan(lambda c, xs: layer_fn(c, unpack_rows(*xs[0]), xs[1]), carry,
                                   ((run_state, packed), indices), host=keep_on_host, policy=kept,
                                   residuals_host=kept_on_host)
        else:
            carry = _scan_layers(lambda c, xs: layer_fn(c, *xs), carry, (run_state, indices), block, outer)
    return carry  # x, or (x, router stats)


def _scan_layers(step, carry, xs, block: int, outer: RematPolicy | None):
    """`step(carry, x)` over the leading axis of `xs` as one scan; with `outer` (nested checkpointing), as an
    outer scan over blocks of `block` steps, each block a checkpoint of policy `outer` around an inner scan, its
    input named `BLOCK_INPUT` (what `outer` keeps or offloads); a last partial block (n % block steps) is one more
    call of the same checkpoint. The backward of a block re-runs its inner scan forward, whose steps are full
    checkpoints: it keeps the block's layer inputs on the device, then differentiates the steps one at a time.

    Why it is shaped so:
    - No XLA pipelined host offloading (`ExecutionConfig.program_options`): its loop peeling holds two [k, T, H]
      buffers of the inner scan's stacked inputs, two layer inputs for each layer of a block past the first.
    - The block's layers are an inner scan, not unrolled: unrolled they keep more (8B at 1 x 65536 in blocks of 4:
      15.44 against 9.90 GiB of temp).
    - The block of weights is scanned, not each layer's row read from the whole stack inside its checkpoint (as the
      periodic scan does): that saves the block's weight slice but costs a layer input, which long rows pay more.
    - Only the outer scan's block inputs reach the host: the last partial block's input, and a single block's
      (an outer scan of one step), stay on the device, since XLA folds a host copy pair outside a loop as in the
      unrolled loop. The host count of `jaxft.memory.policy.offloaded_bytes` is one input high there; the device
      estimate is the compiled one."""
    if outer is None or block <= 1:
        carry, _ = jax.lax.scan(lambda c, x: (step(c, x), None), carry, xs)
        return carry

    def run_block(c, block_xs):
        c = checkpoint_name(c, BLOCK_INPUT)
        c, _ = jax.lax.scan(lambda c, x: (step(c, x), None), c, block_xs)
        return c

    blocked = jax.checkpoint(run_block, policy=outer.jax_policy(), prevent_cse=False)
    n = jax.tree.leaves(xs)[0].shape[0]
    whole = n // block * block
    if whole:
        head = jax.tree.map(lambda a: a[:whole].reshape(whole // block, block, *a.shape[1:]), xs)
        carry, _ = jax.lax.scan(lambda c, x: (blocked(c, x), None), carry, head)
    if whole < n:
        carry = blocked(carry, jax.tree.map(lambda a: a[whole:], xs))
    return carry


def _scanned(state: nnx.State, host_rows, device_rows) -> tuple[nnx.State, dict[tuple, HostRows]]:
    """(the scanned form of a stack's state, {packed buffer key: its streamed rows}): a device leaf as
    `device_rows(leaf)` (the group's rows), a leaf in host memory as `host_rows(leaf)` (a `HostRows`), a packed
    entry (`jaxft.memory.streamed`) as its slot without the buffer, whose rows `host_rows(buffer)` are streamed once for
    all its slots (`unpack_rows` slices them out of the fetched row)."""
    buffers: dict[tuple, HostRows] = {}

    def one(value):
        if _host_rows(value):  # a mixed linear's own rows (`run_rows`)
            return value
        if is_slot(value):
            buffers.setdefault(value.key, host_rows(value.rows))
            return dataclasses.replace(value, rows=None)
        return host_rows(value) if in_host_memory(value) else device_rows(value)

    return jax.tree.map(one, state, is_leaf=lambda v: is_slot(v) or _host_rows(v)), buffers


def _host_rows(value) -> bool:
    return isinstance(value, HostRows)


def _summing_stats(layer_fn):
    """`((x, acc), state, i) -> (x', acc + stats)` for a layer that returns (x', stats)."""
    def fn(carry, layer_state, index):
        x, acc = carry
        x, stats = layer_fn(x, layer_state, index)
        return x, acc + stats
    return fn


def _passing_stats(layer_fn):
    """`((x, acc), state, i) -> (x', acc)` for a layer without a router (a dense layer of a mixed stack)."""
    def fn(carry, layer_state, index):
        x, acc = carry
        return layer_fn(x, layer_state, index), acc
    return fn


def _split_expert_stacks(state: nnx.State) -> tuple[nnx.State, nnx.State | None]:
    """(the state without its `ExpertParam`s, those alone or None): selected by variable type. Streamed expert
    stacks (in host memory, or packed: `frozen_weights: host`) stay in the scanned state: each layer's rows reach
    the device with its other weights, as plain per-layer arrays."""
    flat = nnx.to_flat_state(state)
    experts = [(p, v) for p, v in flat if isinstance(v, ExpertParam) and not _streamed_value(v.get_value())]
    if not experts:
        return state, None
    kept = {p for p, _ in experts}
    return nnx.from_flat_state([(p, v) for p, v in flat if p not in kept]), nnx.from_flat_state(experts)


def _streamed_value(value) -> bool:
    return is_slot(value) or (hasattr(value, "shape") and in_host_memory(value))


def _stack_rows(groups: list[LayerGroup], num_layers: int) -> dict[str, np.ndarray]:
    """{stack name: int32 [num_layers], the row of layer i in that stack (-1 for the other stacks' layers)}."""
    rows: dict[str, np.ndarray] = {}
    for g in groups:
        table = rows.setdefault(g.stack, np.full(num_layers, -1, np.int32))
        table[g.start:g.end] = np.arange(g.first_row, g.first_row + g.end - g.start, dtype=np.int32)
    return rows


def _with_rows(layer_state: nnx.State, stacks: nnx.State, row) -> nnx.State:
    """`layer_state` with the whole `stacks` added back, each as its `StackRow` `row`."""
    rows = [(p, v.replace(StackRow(v.get_value(), row))) for p, v in nnx.to_flat_state(stacks)]
    return nnx.from_flat_state([*nnx.to_flat_state(layer_state), *rows])


def resolve_transfer(policy: RematPolicy, unrolled: bool) -> str:
    """How the layer input reaches the host under `policy`: "explicit" (`jaxft.memory.offload.host_offloaded`) or
    "policy" (jax.checkpoint's offload policy). `policy.transfer` "auto" is explicit in the unrolled loop, whose
    policy offload XLA drops (see `jaxft.memory.offload`), and the policy in the scan, whose offload XLA keeps;
    "explicit" applies to every policy that offloads something: the layer input alone with nothing else kept
    (`RematPolicy.explicit_capable`) by hand with a full recompute, any other through the policy's own vjp
    inside the explicit custom VJP (`host_offloaded(fn, policy)`), whose barriers decide when the copies run."""
    if not policy.offloads or policy.transfer == "policy":
        return "policy"
    if not policy.explicit_capable:
        # Unrolled loops only: in a scan the residuals of this form are stacked host buffers that XLA's layout
        # assignment rejects (JAX 0.11.2: "Expected instruction to have shape equal to"),
        # and there the policy's own offload is kept anyway.
        return "explicit" if unrolled else "policy"
    # In a scan "explicit" is `jaxft.memory.scan_offload` around the whole scan (run_groups), which prefetches the
    # copies back; "auto" keeps the policy there, whose copies XLA already overlaps.
    return "explicit" if policy.transfer == "explicit" or unrolled else "policy"


def _places_memory() -> bool:
    """Whether the platform being traced for (`kernels_pallas._dispatch.target_platform`: a compile for an H200 on a
    CPU-only host too) lowers memory-placement ops (host offload): JAX does so on GPUs and TPUs only."""
    return target_platform() in ("gpu", "tpu")


def _layer_fn(graphdef, layer_ctx, dropout_rng, *, policy: RematPolicy, prevent_cse: bool,
              transfer: str = "policy", row: int | None = None, chain: PrefetchChain | None = None,
              stacks: nnx.State | None = None, stack_rows: np.ndarray | None = None):
    """`(x, layer_state, index) -> x` for one layer, rematerialised per `policy`; `transfer` "explicit" (only
    for a policy that `explicit_capable` accepts) moves the layer input to the host through `jaxft.memory.offload`, with
    its copy back started one layer early when the layers share a `chain` (unrolled loops); "ordered" (policy
    full) is the same custom VJP with the input kept on the device (`host_offloaded(host=False)`).

    `row` (a periodic scan's body): `layer_state` is the period's block of the stack ([c, ...] leaves) and the
    layer's weights are its row `row`. The slice is taken inside the layer's checkpoint and never saved: had the
    body sliced the block before the call, each slice would be a value made inside the scan, which the scan's
    backward keeps as a stacked residual, i.e. a second copy of every layer's frozen weights (Gemma-2-9B: 0.38 of
    0.49 GiB a layer at 1 x 16384 with full remat). The
    block itself is a scan input, which the backward reads in place. (Without remat nothing is gained: see
    below.)

    `stacks` (a scan's whole expert stacks, `_split_expert_stacks`): the layer's `ExpertParam`s hold their row
    `stack_rows[index]` as a `StackRow`; the stacks are arguments of the (checkpointed) layer function, never
    sliced, never residuals."""
    def layer_fn(carry, layer_state, index):
        if stacks is not None:
            layer_state, whole = layer_state
        if row is not None:
            block, r = layer_state if row == DYNAMIC_ROW else (layer_state, row)
            layer_state = jax.tree.map(lambda leaf: leaf[r], block)
        if stacks is not None:
            layer_state = _with_rows(layer_state, whole, jnp.asarray(stack_rows)[index])
        layer = nnx.merge(graphdef, layer_state)
        carry = constrain_rows(carry)  # rows stay split: the partitioner gathers this layer's weights instead
        carry = checkpoint_name(carry, LAYER_INPUT)  # a no-op unless the policy keeps or offloads it
        rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, index)
        return layer(carry, layer_ctx, rng)

    if not policy.checkpointed:
        # Without remat the backward keeps the weights the matmuls read, whichever way they are sliced (a
        # save-anything-but-the-slice checkpoint measured 1 GiB more on 4 Gemma-2-9B layers), so no remat is
        # unrolled by default (`ExecutionConfig.resolved_layer_loop`).
        fn = layer_fn
    elif transfer in ("explicit", "ordered"):  # a custom VJP whose barriers order copies and recompute
        offloaded = (host_offloaded(layer_fn, None, chain, host=False) if transfer == "ordered" else
                     host_offloaded(layer_fn, None if policy.explicit_capable else policy.jax_policy(), chain))
        fn = lambda carry, layer_state, index: offloaded(carry, layer_state, layer_index(index))  # noqa: E731
    else:
        fn = jax.checkpoint(layer_fn, policy=policy.jax_policy(), prevent_cse=prevent_cse)
    if stacks is None:
        return fn
    return lambda carry, layer_state, index: fn(carry, (layer_state, stacks), index)
