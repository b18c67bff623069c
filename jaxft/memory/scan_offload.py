"""A layer scan whose carries live in pinned host memory between its forward and backward, copied back one
iteration ahead: remat "offload" (the layer input to the host, everything else recomputed) for a `jax.lax.scan`,
written as one custom VJP around the whole scan.

Why: with jax.checkpoint's offload policy inside the scan, whether a layer input's copy back overlaps compute is
XLA's choice, and in a small scan it waits for the copy before the layer's first matmul. Here the overlap is written
out: the backward is a reverse scan whose iteration i starts copying iteration i - 1's carry back before it
recomputes and differentiates iteration i, and hands the copy to the next iteration through its own carry. The
forward's copies to the host are pipelined by XLA (`ExecutionConfig.program_options`). Opt-in
(`offload_transfer: explicit` with `layer_loop: scan`): where XLA already overlaps the policy's copies (GPT-OSS-20B
lean, 1 x 4096) it is 2% slower than the policy.

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
over streamed weights). Weights packed for streaming (`PackedSlot`, `jaxft.memory.streamed`: one [L, total] host buffer
per stack and dtype) are fetched as one row per layer and sliced apart on the device (`unpack_rows`): one copy per
layer, which XLA runs under the layer's compute, where one copy per weight runs mostly exposed.

Fetches: every read of a stack in pinned host memory inside the loops (a streamed row, a kept carry or residual
coming back) is a dynamic slice whose index is affine in the loop's counter and never leaves the stack. XLA then
runs it as a copy (a dynamic-slice config, no kernel); an index read from a scanned array, or clamped
(min(i + 1, L - 1)), makes it a loop fusion instead: a kernel whose threads read host memory over PCIe on the SMs
the matmuls need. So the forward loop runs iterations 0 .. L-2, fetching iteration i + 1's rows, and
the last iteration runs after it (its kept values apart from the loop's stacks); the backward loop's step k
differentiates iteration L-1-k from what the step before fetched while it fetches iteration L-2-k's, and
iteration 0 runs after it. Each f is traced twice in each direction (compile time), and an iteration's kept
inputs come back together, one step early: with a period of p layers per iteration (`fs`) its p layer inputs are on
the device through its backward, where each came back one layer early before (the loop's index into the stacks
cannot reach iteration L-1's own, which the last forward iteration keeps apart). XLA's pipelined host
offloading would rewrite these loops and turn the fetches back into kernels: `ExecutionConfig.program_options`
leaves it off here.

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

from jaxft.memory.offload import _hoist_constants

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
        # f is traced twice (in the forward loop and for the last iteration); one backward loop rebuilds the vjps of
        # both, so both must keep the same values (the trees hold each trace's own jaxpr of the same computation).
        if self.specs[j] is not None and (self.specs[j][1] != spec or self.specs[j][0].num_leaves != tree.num_leaves):
            raise AssertionError(f"offloaded_scan: f{j} keeps different residuals in the loop and the last iteration")
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
    # On the CPU JAX lowers no placement: both copies are identities there (as in jaxft.memory.offload).
    return jax.device_put(leaf, space)


def _row(leaf, i):
    """Row i of a stacked leaf: inside the loops i is affine in the loop counter and within range, so XLA copies a row
    of a pinned host stack as a memcpy (module docstring, "Fetches")."""
    return jax.lax.dynamic_index_in_dim(leaf, i, keepdims=False)


def _back(stack, value):
    """`value` (a row or the whole of `stack`) on the device: copied back where `stack` lives in host memory."""
    return _to(value, Space.Device) if in_host_memory(stack) else value


def _forward(fs, host, layout, carry, scanned, stacks, consts, keep: bool, policy=None, want=None, cell=None,
             saved_host: bool = False):
    """The scan, each iteration fetching the next one's streamed rows; with `keep`, also the carries before each
    f (on the host when `host`, rank >= 2 leaves) and, with `policy`, what it saves of each f (`_Residuals`; on
    the host when `saved_host`, rank >= 2 leaves). Iterations 0 .. n-2 run in the loop, whose stacks have n - 1
    rows; the last runs after it (its kept values unstacked), so no fetch in the loop reaches past the stack.
    Returns (last carry, (kept stacks, last kept), (saved stacks, last saved), the last iteration's rows)."""
    n = layout.length

    def iteration(c, w, sliced):
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
        return c, kept, saved

    if not (keep or stacks):  # nothing fetched ahead, nothing kept: the plain scan
        return jax.lax.scan(lambda c, sliced: (iteration(c, [], sliced)[0], None), carry, scanned)[0], None, None, []

    def body(state, _):
        c, w, i = state
        w_next = layout.fetch(stacks, i + 1)  # started here, used in the next iteration
        c, kept, saved = iteration(c, w, [_row(leaf, i) for leaf in scanned])
        return (c, w_next, i + 1), (kept, saved)

    w, kept, saved = layout.fetch(stacks, 0), None, None
    if n > 1:
        (carry, w, _), (kept, saved) = jax.lax.scan(body, (carry, w, jnp.int32(0)), None, length=n - 1)
    out, kept_last, saved_last = iteration(carry, w, [_row(leaf, n - 1) for leaf in scanned])
    return out, (kept, kept_last), (saved, saved_last), w


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
    _, policy, cell, _ = how
    (kept, kept_last), (saved, saved_last), scanned, stacks, consts, w_last, flags = res
    carry_flags, scanned_flags, const_flags = flags
    g_out = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype) if isinstance(t, SymbolicZero) else t, g_out,
                         is_leaf=lambda t: isinstance(t, SymbolicZero))
    n, p = layout.length, len(fs)
    x_want = [i for i, m in enumerate(jax.tree.leaves(scanned_flags)) if m]
    c_want = [i for i, m in enumerate(jax.tree.leaves(const_flags)) if m]

    def on_device(kept, saved, take):
        """An iteration's kept inputs (one per f) and kept residuals, `take(stack)` of each (its row, or the whole
        of the last iteration's), those in host memory copied back to the device (started here, used later)."""
        return ([jax.tree.map(lambda s: _back(s, take(s)), kept[j]) for j in range(p)],
                [[_back(s, take(s)) for s in saved[j]] for j in range(p)] if policy is not None else None)

    def differentiate(g, acc, inputs, w, stacked, sliced):
        """Iteration's backward from its inputs, rows and kept residuals: (g before it, acc + its constants'
        cotangents, its scanned inputs' cotangents)."""
        x_diff = [sliced[j] for j in x_want]
        c_diff = [consts[j] for j in c_want]
        gx = [jnp.zeros_like(v) for v in x_diff]
        for j in reversed(range(p)):
            if policy is None:  # recompute f from its input
                _, vjp = jax.vjp(lambda c, xd, cd, f=fs[j]: _call(f, layout, c, sliced, w, consts, (x_want, c_want),
                                                                  xd, cd), inputs[j], x_diff, c_diff)
            else:  # the forward's vjp, its kept residuals from the stacks, the rest where the forward found them
                vjp = cell.rebuild(j, {"c": jax.tree.leaves(inputs[j]), "w": list(w), "k": list(consts),
                                       "x": list(sliced)}, stacked[j])
            g, gxj, gcj = vjp(g)
            gx = [a + b for a, b in zip(gx, gxj)]
            acc = [a + b for a, b in zip(acc, gcj)]
        return g, acc, gx

    def body(state, _):
        # Step k differentiates iteration i + 1 = n - 1 - k from what the previous step fetched, and fetches
        # iteration i's inputs, residuals and streamed rows under it.
        g, acc, inputs, w, stacked, k = state
        i = n - 2 - k
        w_below = layout.fetch(stacks, i)
        inputs_below, stacked_below = on_device(kept, saved, lambda s: _row(s, i))
        g, acc, gx = differentiate(g, acc, inputs, w, stacked, [_row(leaf, i + 1) for leaf in scanned])
        return (g, acc, inputs_below, w_below, stacked_below, k + 1), gx

    inputs, stacked = on_device(kept_last, saved_last, lambda s: s)
    state = (g_out, [jnp.zeros_like(consts[i]) for i in c_want], inputs, w_last, stacked, jnp.int32(0))
    if n > 1:  # reverse: row r of the stacked cotangents is iteration r + 1's
        state, g_xs = jax.lax.scan(body, state, None, length=n - 1, reverse=True)
    g0, acc, inputs, w, stacked, _ = state
    g0, acc, gx0 = differentiate(g0, acc, inputs, w, stacked, [_row(leaf, 0) for leaf in scanned])
    dx = [None] * len(scanned)
    for k, (i, g) in enumerate(zip(x_want, gx0)):
        dx[i] = g[None] if n == 1 else jnp.concatenate([g[None], g_xs[k]])
    dc = [None] * len(consts)
    for i, g in zip(c_want, acc):
        dc[i] = g
    return (g0 if any(jax.tree.leaves(carry_flags)) else None, dx, [None] * len(stacks), *dc)


_scan.defvjp(_scan_fwd, _scan_bwd, symbolic_zeros=True)
