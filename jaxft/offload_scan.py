"""A layer scan whose carries live in pinned host memory between its forward and backward, copied back one
iteration ahead: remat "offload" (the layer input to the host, everything else recomputed) for a `jax.lax.scan`,
written as one custom VJP around the whole scan.

Why: with jax.checkpoint's offload policy inside the scan, whether a layer input's copy back overlaps compute is
XLA's choice. In a toy scan compiled for an H200 (`scripts/deviceless/scan_offload_schedule.py`) the copy back
is waited for before the layer's first matmul (0 GEMMs between the copy's start and its done); in 4 Llama layers
of 2048 width at 1 x 4096 compiled the same way, XLA overlapped it with 43 GEMMs. Here the overlap is written out:
the backward is a reverse scan whose iteration i starts copying iteration i - 1's carry back before it recomputes
and differentiates iteration i, and hands the copy to the next iteration through its own carry (3 of 3 GEMMs in
the toy). The forward's copies to the host are pipelined by XLA (`ExecutionConfig.program_options`). Opt-in
(`offload_transfer: explicit` with `layer_loop: scan`): measured on an H200 (GPT-OSS-20B lean, 1 x 4096,
docs/benchmarks.md section 24) it is 6.7 ms a step slower than the policy (294.7 vs 288.0 ms), whose copies cost
nothing there (the step without any host copy: 287.4 ms); in the Llama compile it costs 16 MiB more temp (the
prefetched input).

Math: for carry_{i+1} = f(carry_i, x_i, consts), the forward keeps carry_i (on the host when it is an array of
rank >= 2, else on the device: the router statistics' small accumulator) and returns carry_L. The backward, from
g_L = d loss / d carry_L, runs i = L-1 .. 0: (g_i, d x_i, d consts_i) = vjp_f(carry_i, x_i, consts)(g_{i+1}) and
returns g_0, the stacked d x_i and sum_i d consts_i - exactly the gradients of full remat (f is recomputed from a
bitwise copy of its input). Only the leaves the caller differentiates are differentiated (`symbolic_zeros`): the
frozen weights among the scanned inputs and the hoisted constants (RoPE tables, masks, expert stacks) get no
cotangent computed.

Streamed weights (`HostRows`, `ExecutionConfig.frozen_weights: host`): a scanned input may be a stack that lives in
pinned host memory (the frozen weights of the layer stack). It is never sliced by the scan: iteration i copies its
rows to the device one iteration early - the forward fetches layer i + 1's weights while layer i runs, the backward
layer i - 1's while layer i recomputes and differentiates - so at most two layers' weights are on the device at a
time and the copies run under compute. The forward's last fetch (the top layer) is the backward's first weights.
These inputs are frozen: nothing differentiates them. `host=False` keeps the carries on the device (remat "full"
over streamed weights). Weights packed for streaming (`PackedSlot`, `jaxft.streamed`: one [L, total] host buffer
per stack and dtype) are fetched as one row per layer and sliced apart on the device (`unpack_rows`): one copy per
layer, which XLA runs under the layer's compute, where one copy per weight ran mostly exposed
(scripts/deviceless/stream_schedule.py).

Kept residuals (`policy`, any `jax.checkpoint` policy that keeps values on the device): the forward runs each f as
the vjp of `jax.checkpoint(f, policy)` and stacks what that vjp holds, except the values the scan has anyway - the
carry (kept as above), the streamed weights (fetched again), the hoisted constants and the scanned slices, found
by identity (`_Residuals`); the backward rebuilds each vjp from those and the stacked residuals, so it recomputes
only what the policy did not keep (offload+attn over streamed weights: not the attention). With `residuals_host`
the stacked residuals (rank >= 2) wait in pinned host memory like the carries and come back one layer ahead of
their backward. Without a policy the backward recomputes f whole (the module's first form).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxft.offload import _hoist_constants

Space = jax.memory.Space


@dataclasses.dataclass(frozen=True)
class HostRows:
    """A scanned input read from a stack in pinned host memory, one iteration at a time: iteration i reads rows
    [start + i*size, start + (i+1)*size) of `stack` (`size` None: row start + i, without its axis), copied to the
    device one iteration ahead (module docstring). The stack itself is never sliced on the host."""

    stack: jax.Array
    start: int = 0
    size: int | None = None

    def rows(self, i):
        if self.size is None:
            return jax.lax.dynamic_index_in_dim(self.stack, self.start + i, keepdims=False)
        return jax.lax.dynamic_slice_in_dim(self.stack, self.start + i * self.size, self.size)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PackedSlot:
    """A streamed stack entry: elements [offset, offset + prod(shape)) of each row of `rows` (the [L, total] buffer
    `key` = (stack name, dtype name)), shaped `shape` per layer."""

    rows: Any
    key: tuple[str, str]
    offset: int
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def tree_flatten(self):
        return (self.rows,), (self.key, self.offset, self.shape)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)


def is_slot(value) -> bool:
    return isinstance(value, PackedSlot)


def unpack_rows(state, rows: dict[tuple, jax.Array]):
    """A layer state whose slots hold (key, offset, shape) only, with each slot replaced by its weight sliced out of
    the fetched row(s) `rows[key]` ([total] for one layer, [c, total] for a period's c layers)."""
    def take(slot):
        row = rows[slot.key]
        part = jax.lax.slice_in_dim(row, slot.offset, slot.offset + slot.size, axis=row.ndim - 1)
        return part.reshape(*row.shape[:-1], *slot.shape)
    return jax.tree.map(lambda v: take(v) if is_slot(v) else v, state, is_leaf=is_slot)


def in_host_memory(leaf) -> bool:
    """Whether an array (or a traced value) lives in pinned host memory: how the frozen weights placed there
    (`jaxft.run.Run`, `frozen_weights: host`) show inside the step."""
    return getattr(jax.typeof(leaf), "memory_space", None) == Space.Host


def offloaded_scan(fs, carry, xs, *, host: bool = True, policy=None, residuals_host: bool = False):
    """`jax.lax.scan` of one iteration = `fs` applied in order (a callable or a sequence of them: the layers of one
    period of a periodic stack, each `f(c, x) -> c` on the same scanned slice x), returning the last carry, with
    the backward of full remat whose layer inputs (the carry before each f) wait in pinned host memory (`host`;
    else on the device) and come back one layer early (module docstring). Each f may close over traced values
    (hoisted as constants, never differentiated). Leaves of `xs` may be `HostRows`: streamed, never
    differentiated. With `policy` (a `jax.checkpoint` policy that keeps residuals on the device) the forward also
    keeps what the policy saves of each f, stacked by the scan, and the backward recomputes only the rest
    (`_Residuals`); the carries and streamed weights are never among them. `residuals_host`: those kept residuals
    (arrays of rank >= 2) wait in pinned host memory like the carries, each layer's come back one layer early."""
    fs = (fs,) if callable(fs) else tuple(fs)
    leaves, tree = jax.tree.flatten(xs, is_leaf=lambda t: isinstance(t, HostRows))
    views = tuple((k, leaf.start, leaf.size) for k, leaf in enumerate(leaves) if isinstance(leaf, HostRows))
    stacks = [leaf.stack for leaf in leaves if isinstance(leaf, HostRows)]
    scanned = [leaf for leaf in leaves if not isinstance(leaf, HostRows)]
    if not scanned:
        raise ValueError("offloaded_scan: no scanned input besides streamed ones (pass the iteration indices)")
    layout = _Layout(tree, len(leaves), views, scanned[0].shape[0])
    x0 = layout.merge([leaf[0] for leaf in scanned], layout.fetch(stacks, 0))  # traced for shapes only
    converted, consts = [], []
    for f in fs:
        g, c = _hoist_constants(f, carry, x0)
        converted.append((g, len(consts), len(c)))
        consts += c  # every f maps the carry to a carry of the same structure (a scan's)
    how = (host, policy, _Residuals(len(fs)), residuals_host and policy is not None)
    return _scan(tuple(converted), how, layout, carry, scanned, stacks, *consts)


def _view(stack, view) -> HostRows:
    _, start, size = view
    return HostRows(stack, start, size)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where the streamed inputs sit among the flattened scanned inputs (static, hashable)."""

    tree: jax.tree_util.PyTreeDef
    count: int
    views: tuple[tuple[int, int, int | None], ...]
    length: int

    def merge(self, scanned_slices, fetched):
        """The iteration's inputs: scanned slices and fetched (device) rows back in their places."""
        at = {k: w for (k, _, _), w in zip(self.views, fetched)}
        rest = iter(scanned_slices)
        return jax.tree.unflatten(self.tree, [at[k] if k in at else next(rest) for k in range(self.count)])

    def fetch(self, stacks, i):
        """Iteration i's streamed rows, copied to the device (started here; used where the caller uses them)."""
        return [_to(_view(s, v).rows(i), Space.Device) for s, v in zip(stacks, self.views)]


class _Residuals:
    """What a policy's vjp of each f keeps, as the forward traced it: the vjp's pytree structure and, per leaf, where
    the backward finds it - the carry before f ("c"), a streamed weight ("w"), a constant ("k"), a scanned slice
    ("x"), each by identity with the value the forward passed in, else the j-th value the forward stacked
    ("saved"). So the weights a matmul's vjp holds are refetched, not stacked, and the carry comes from the scan's
    own copy (on the host for remat offload)."""

    def __init__(self, count: int):
        self.specs: list = [None] * count

    def record(self, j: int, vjp, known: dict[str, list]) -> list:
        leaves, tree = jax.tree.flatten(vjp)
        where = {id(v): (kind, k) for kind, values in known.items() for k, v in enumerate(values)}
        spec, saved = [], []
        for leaf in leaves:
            if id(leaf) in where:
                spec.append(where[id(leaf)])
            else:
                spec.append(("saved", len(saved)))
                saved.append(leaf)
        self.specs[j] = (tree, spec)
        return saved

    def rebuild(self, j: int, known: dict[str, list], saved: list):
        tree, spec = self.specs[j]
        return jax.tree.unflatten(tree, [saved[k] if kind == "saved" else known[kind][k] for kind, k in spec])


def _call(f, layout, c, sliced, w, consts, want, x_diff, c_diff):
    """f on the full inputs with the differentiated leaves (`want`: scanned, constant positions) replaced by
    `x_diff` / `c_diff`."""
    x_want, c_want = want
    sl, cl = list(sliced), list(consts)
    for i, v in zip(x_want, x_diff):
        sl[i] = v
    for i, v in zip(c_want, c_diff):
        cl[i] = v
    return _apply(f, c, layout.merge(sl, w), cl)


def _apply(f, c, x, consts):
    g, start, count = f
    return g(c, x, *consts[start:start + count])


def _host(leaf) -> bool:
    """Whether a carry leaf waits on the host: the activations (rank >= 2), not small accumulators."""
    return jnp.ndim(leaf) >= 2


def _to(leaf, space):
    # On the CPU JAX lowers no placement: both copies are identities there (as in jaxft.offload).
    return jax.device_put(leaf, space)


def _forward(fs, host, layout, carry, scanned, stacks, consts, keep: bool, policy=None, want=None, cell=None,
             saved_host: bool = False):
    """The scan, each iteration fetching the next one's streamed rows; with `keep`, also the carries before each
    f (on the host when `host`, rank >= 2 leaves) and, with `policy`, what it saves of each f (`_Residuals`; on
    the host when `saved_host`, rank >= 2 leaves). Returns (last carry, kept, saved, the last fetched rows)."""
    n = layout.length

    def body(state, inputs):
        c, w = state
        sliced, i = inputs
        w_next = layout.fetch(stacks, jnp.minimum(i + 1, n - 1))  # the last iteration's is the backward's first
        x = layout.merge(sliced, w)
        kept, saved = [], []
        for j, f in enumerate(fs):
            if keep:
                kept.append(jax.tree.map(lambda leaf: _to(leaf, Space.Host) if host and _host(leaf) else leaf, c))
            if keep and policy is not None:
                x_diff, c_diff = [sliced[k] for k in want[0]], [consts[k] for k in want[1]]
                fn = jax.checkpoint(lambda c, xd, cd, f=f: _call(f, layout, c, sliced, w, consts, want, xd, cd),
                                    policy=policy)
                out, vjp = jax.vjp(fn, c, x_diff, c_diff)
                rec = cell.record(j, vjp, {"c": jax.tree.leaves(c), "w": list(w), "k": list(consts),
                                           "x": list(sliced)})
                saved.append([_to(v, Space.Host) if saved_host and _host(v) else v for v in rec])
                c = out
            else:
                c = _apply(f, c, x, consts)
        return (c, w_next), (kept, saved)

    (out, w_last), (kept, saved) = jax.lax.scan(body, (carry, layout.fetch(stacks, 0)),
                                                (scanned, jnp.arange(n, dtype=jnp.int32)))
    return out, kept, saved, w_last


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _scan(fs, how, layout, carry, scanned, stacks, *consts):
    return _forward(fs, how[0], layout, carry, scanned, stacks, consts, keep=False)[0]


def _scan_fwd(fs, how, layout, carry, scanned, stacks, *consts):
    host, policy, cell, saved_host = how
    flags = jax.tree.map(lambda p: p.perturbed, (carry, scanned, consts))
    if any(p.perturbed for p in jax.tree.leaves(stacks)):
        raise ValueError("offloaded_scan: a streamed input (HostRows, weights in host memory) is differentiated; "
                         "only frozen weights are streamed")
    carry, scanned, stacks, consts = jax.tree.map(lambda p: p.value, (carry, scanned, stacks, consts))
    want = ([i for i, m in enumerate(jax.tree.leaves(flags[1])) if m],
            [i for i, m in enumerate(jax.tree.leaves(flags[2])) if m])
    out, kept, saved, w_last = _forward(fs, host, layout, carry, scanned, stacks, consts, keep=True, policy=policy,
                                        want=want, cell=cell, saved_host=saved_host)
    return out, (kept, saved, scanned, stacks, consts, w_last, flags)


def _scan_bwd(fs, how, layout, res, g_out):
    host, policy, cell, saved_host = how
    kept, saved, scanned, stacks, consts, w_last, (carry_flags, scanned_flags, const_flags) = res
    g_out = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype) if isinstance(t, SymbolicZero) else t, g_out,
                         is_leaf=lambda t: isinstance(t, SymbolicZero))
    n, p = layout.length, len(fs)
    x_want = [i for i, m in enumerate(jax.tree.leaves(scanned_flags)) if m]
    c_want = [i for i, m in enumerate(jax.tree.leaves(const_flags)) if m]
    carry_wanted = any(jax.tree.leaves(carry_flags))

    def input_of(i, j):
        """The carry before f_j of iteration i, copied back to the device (started here, used later)."""
        return jax.tree.map(lambda leaf: _to(jax.lax.dynamic_index_in_dim(leaf, i, keepdims=False), Space.Device)
                            if host and _host(leaf) else jax.lax.dynamic_index_in_dim(leaf, i, keepdims=False),
                            kept[j])

    def saved_of(i):
        """Iteration i's kept residuals (`saved_host`), those in host memory copied back to the device (started
        here, used in the next iteration)."""
        return [[_to(take, Space.Device) if in_host_memory(leaf) else take
                 for leaf in stack for take in [jax.lax.dynamic_index_in_dim(leaf, i, keepdims=False)]]
                for stack in saved]

    def body(state, inputs):
        if saved_host:  # this layer's residuals came back in the previous iteration; the next layer's start now
            g, cur, w, acc, stacked = state
            sliced, i = inputs
            stacked_below = saved_of(jnp.maximum(i - 1, 0))
        else:  # sliced by the scan, on the device
            g, cur, w, acc = state
            sliced, stacked, i = inputs
        # The prefetches of the layer below: its input and its streamed weights come back under this layer's
        # recompute and backward.
        w_below = layout.fetch(stacks, jnp.maximum(i - 1, 0))
        x_diff = [sliced[j] for j in x_want]
        c_diff = [consts[j] for j in c_want]
        gx = [jnp.zeros_like(v) for v in x_diff]
        for j in reversed(range(p)):
            below = input_of(jnp.maximum(i - 1, 0), p - 1) if j == 0 else input_of(i, j - 1)
            if policy is None:  # recompute f from its input
                _, vjp = jax.vjp(lambda c, xd, cd, f=fs[j]: _call(f, layout, c, sliced, w, consts, (x_want, c_want),
                                                                  xd, cd), cur, x_diff, c_diff)
            else:  # the forward's vjp, its kept residuals from the stacks, the rest where the forward found them
                vjp = cell.rebuild(j, {"c": jax.tree.leaves(cur), "w": list(w), "k": list(consts),
                                       "x": list(sliced)}, stacked[j])
            g, gxj, gcj = vjp(g)
            gx = [a + b for a, b in zip(gx, gxj)]
            acc = [a + b for a, b in zip(acc, gcj)]
            cur = below
        return ((g, cur, w_below, acc) + ((stacked_below,) if saved_host else ())), gx

    zeros_c = [jnp.zeros_like(consts[i]) for i in c_want]
    steps = jnp.arange(n, dtype=jnp.int32)
    if saved_host:
        init, xs = (g_out, input_of(n - 1, p - 1), w_last, zeros_c, saved_of(n - 1)), (scanned, steps)
    else:
        init, xs = (g_out, input_of(n - 1, p - 1), w_last, zeros_c), (scanned, saved, steps)
    final, g_xs = jax.lax.scan(body, init, xs, reverse=True)
    g0, g_consts = final[0], final[3]
    dx = [None] * len(scanned)
    for i, g in zip(x_want, g_xs):
        dx[i] = g
    dc = [None] * len(consts)
    for i, g in zip(c_want, g_consts):
        dc[i] = g
    return (g0 if carry_wanted else None, dx, [None] * len(stacks), *dc)


_scan.defvjp(_scan_fwd, _scan_bwd, symbolic_zeros=True)
