"""Explicit host offload of a layer's input: the forward copies it to pinned host memory, the backward copies it
back and recomputes the layer from it (what remat "offload" means), with the two transfers written out in a
`custom_vjp` instead of left to `jax.checkpoint`'s offload policy.

Why: with the policy, JAX lowers the residual as MoveToHost in the forward and MoveToDevice in the backward
(`annotate_device_placement` custom calls). XLA's host offloader turns them into a copy to memory space 5 and a
copy back. Inside a layer scan the copies go through the loop's stacked residual buffer (a dynamic-update-slice
into a host buffer, a dynamic-slice out of it) and survive; in an unrolled program the copy back reads the copy
to the host directly, and XLA's algebraic simplifier folds Copy(Copy(x)) with equal outer and inner shapes
(layouts, memory space included) into x (`AlgebraicSimplifierVisitor::HandleCopy`): the offload is silently
dropped (no S(5) value is left in the compiled unrolled program).

Here the backward passes the host copy through an `optimization_barrier` together with a signal before copying it
back. XLA's host offloader accepts a barrier on a host-memory path
(`host_offload_utils::IsValidDuringPureMemoryOffload`), the simplifier no longer sees a copy of a copy, and the
copy back cannot be scheduled before the signal exists: the start of the backward of the layer above in an
unrolled loop (`PrefetchChain`: the copy runs under that layer's compute, and at most two layer inputs are back
on the device at a time, not all of them prefetched at once), else this layer's own output cotangent. The
recompute waits for this layer's output cotangent (a second barrier). The barriers also keep XLA from merging the
recompute with the forward on backends that lower no placement (the CPU: there both transfers are identities).

Two more barriers decide what the device keeps (without them the unrolled offload's temp is about no remat's;
with them, below full remat's; tests/test_offload_order.py checks them on the jaxpr):
- the forward holds the host copy together with the layer's output, so the copy completes before the next layer
  starts and the device x dies there (else its completion is scheduled beside its only use, in the backward, and
  every layer input stays on the device through the forward);
- the backward holds this layer's weight cotangents together with its input cotangent, so the layer below cannot
  start its backward before this layer's LoRA weight gradients exist. Without it XLA's scheduler puts every
  layer's weight-gradient matmuls at the end of the program, beside the stacked gradient they feed, and their
  operands - each layer's recomputed activations - stay live through the whole backward. Only the cotangents
  the caller differentiates are in it (`symbolic_zeros`: the perturbed bits): a barrier keeps every operand alive,
  so a frozen weight's cotangent in it would be computed instead of dropped as dead code.

Math: for y = f(x, p), the backward returns vjp_f(x, p)(dy) evaluated at x itself (the host copy is a bitwise
copy), i.e. exactly the gradients of f recomputed from its input - those of remat "full".
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

Space = jax.memory.Space  # Host: pinned host memory; Device: the accelerator's own (an attribute, not a module)


def host_offloaded(fn: Callable, policy: Callable | None = None, chain: "PrefetchChain | None" = None,
                   host: bool = True) -> Callable:
    """`fn(x, *args) -> y` whose backward pass keeps nothing on the device: the forward keeps `x` in pinned host
    memory (and `args`, the layer's parameters and index, as they are); the backward copies `x` back (as soon as
    the layer above starts its backward with a `chain`) and, once this layer's output cotangent exists,
    differentiates `fn` there (a full recompute). `x` must be one array. `fn` may
    close over traced values (the layer's RoPE tables, positions, dropout key): they become explicit arguments
    (`_hoist_constants`), as a custom VJP requires.

    With `policy` (a `jax.checkpoint` policy, e.g. `save_and_offload_only_these_names`) the layer keeps what the
    policy keeps instead: the forward is the vjp of `jax.checkpoint(fn, policy)`, its residuals (device-saved and
    host-offloaded values) are this custom VJP's residuals, held with the layer output (so the copies to the host
    complete inside the layer); the backward copies the host ones back as it does `x` (`_copied_back`; the
    policy's own placements then find them on the device) and recomputes only what the policy did not keep.

    With `host=False` (and no policy) `x` stays on the device: remat "full" with this VJP's order, the recompute
    waiting for the layer's output cotangent and the weight gradients done before the input cotangent leaves.
    Why: in an unrolled loop that also moves other layers' residuals to the host (per-layer policies), XLA's scheduler
    runs the recomputes of `jax.checkpoint`'s full layers early, beside the copies back, and holds them all at once
    (8B, 1 x 16384 packed, full on layers 0-15 and offload_all on 16-31: temp 33.74 GiB against 6.92 with full on
    every layer)."""

    def call(x, *args):
        converted, consts = _hoist_constants(fn, x, *args)
        signal = jnp.zeros((), jnp.float32) if chain is None else chain.signal
        y, signal = _offloaded(converted, len(consts), policy, host, x, signal, *args, *consts)
        if chain is not None:
            chain.signal = signal
        return y

    return call


class PrefetchChain:
    """The signal that lets each layer's copy back start one layer early, threaded through the layers of ONE
    unrolled loop while it is traced (`jaxft.models.stack.run_groups` makes one per trace; never shared).

    Each `host_offloaded` layer takes a float32 scalar from the layer below and passes one to the layer above,
    through its custom VJP, which does nothing with it in the forward. In the backward the scalar's cotangent is
    the signal: layer i+1 makes it from its output cotangent as soon as that exists (the start of its backward),
    and layer i starts copying its input back once the signal exists, i.e. while layer i+1 recomputes and
    differentiates, instead of after layer i+1 has finished (a barrier on layer i's own output cotangent, which
    is layer i+1's input cotangent, its last product), where the unrolled backward waits ~1.2 ms per layer for its
    copy back (8B widths, 1 x 8192). At
    most two layers' offloaded residuals are on the device at once (under a policy that offloads more than the
    layer input, all of its host residuals are copied back this way, outside its vjp). In a scan the signal
    would come from the previous iteration, which holds nothing for this one: a scan's layer function gets no
    chain (the signal is then a constant; explicit transfers are unrolled only anyway, ExecutionConfig)."""

    def __init__(self):
        self.signal = jnp.zeros((), jnp.float32)


def _hoist_constants(fn: Callable, *args):
    """(g, consts) with g(*args, *consts) == fn(*args) and no traced value closed over in g: every constant of
    fn's jaxpr is hoisted, integer ones too (`jax.closure_convert` keeps integer tracers closed over, which
    leak out of a custom VJP inside a scan: the positions and attention metadata are int32)."""
    leaves, in_tree = jax.tree.flatten(args)
    closed, out_shape = jax.make_jaxpr(lambda *flat: fn(*jax.tree.unflatten(in_tree, flat)),
                                       return_shape=True)(*leaves)
    out_tree = jax.tree.structure(out_shape)
    n_consts = len(closed.consts)

    def converted(*args_and_consts):
        consts = args_and_consts[len(args_and_consts) - n_consts:]
        flat = jax.tree.leaves(args_and_consts[:len(args_and_consts) - n_consts])
        return jax.tree.unflatten(out_tree, jax.core.eval_jaxpr(closed.jaxpr, consts, *flat))

    return converted, list(closed.consts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _offloaded(fn, n_consts, policy, host, x, signal, *args):
    return fn(x, *args), signal


def _offloaded_fwd(fn, n_consts, policy, host, x, signal, *args):
    """Primal output (and the prefetch signal, passed through) and residuals (x on the host, the arguments, which
    of them are differentiated). With `symbolic_zeros` every leaf arrives as a `CustomVJPPrimal` (value,
    perturbed); the perturbed bits travel to the backward as the structure of `flags` (an empty tuple for a
    perturbed leaf, None otherwise: no array), so the backward differentiates only what the caller
    differentiates."""
    x, x_perturbed = x.value, x.perturbed
    flags = jax.tree.map(lambda p: () if p.perturbed else None, args)
    marks = (() if x_perturbed else None, () if signal.perturbed else None)
    args = jax.tree.map(lambda p: p.value, args)
    if policy is not None:
        y, res = _policy_fwd(fn, n_consts, policy, x, x_perturbed, args, flags)
        return (y, signal.value), (res, marks)
    y = fn(x, *args)
    # The copy to the host completes before y leaves the layer: the next layer cannot start until it is done, so
    # the device x dies here (without this the copy's completion is scheduled next to its only use, in the
    # backward pass, and every layer input stays on the device through the forward).
    x_host, y = jax.lax.optimization_barrier((jax.device_put(x, Space.Host) if host else x, y))
    return (y, signal.value), ((x_host, args, flags), marks)


def _offloaded_bwd(fn, n_consts, policy, host, res, cts):
    """Cotangents for x and the differentiated explicit arguments; None for the rest and for the hoisted
    constants (the layer's RoPE tables, positions, masks, dropout key: nothing trainable reaches a layer other
    than through its arguments). Not differentiating them matters: a constant can be an input of a custom VJP
    inside the layer (e.g. the NF4 code table of the 4-bit matmul), and JAX refuses to differentiate a custom VJP
    in what it closes over; and the frozen weights' cotangents must not be computed (see the last barrier)."""
    dy, above = jax.tree.map(_instantiate, cts, is_leaf=lambda t: isinstance(t, SymbolicZero))
    res, (x_flag, signal_flag) = res
    # This layer's backward starts once dy exists: the layer below may start its copy back then (PrefetchChain).
    dy, below = jax.lax.optimization_barrier((dy, jnp.zeros((), jnp.float32)))
    below = below if signal_flag == () else None
    if policy is not None:
        return _policy_bwd(n_consts, res, dy, above, below)
    x_host, args, flags = res
    (x,), dy = _copied_back([x_host], above, dy)
    layer, diff, unsplit = _differentiated(fn, n_consts, args, flags)
    _, vjp = _vjp(layer, x, x_flag == (), diff)
    return _cotangents(vjp, dy, unsplit, n_consts, below)


def _copied_back(values: list, above, dy):
    """(`values` on the device, dy). Those in host memory are copied back once `above` exists (the start of the
    layer above's backward with a `PrefetchChain`, else a constant); the barrier holding them with it also hides
    each host copy from Copy(Copy) folding (module docstring). The results are held with dy, so the recompute
    that reads them waits for this layer's output cotangent."""
    host = [i for i, value in enumerate(values) if jax.typeof(value).memory_space == Space.Host]
    on_host, above = jax.lax.optimization_barrier(([values[i] for i in host], above))
    values = list(values)
    for i, value in zip(host, on_host):
        values[i] = jax.device_put(value, Space.Device)
    return jax.lax.optimization_barrier((values, dy))


def _differentiated(fn, n_consts, args, flags):
    """(layer(x, diff), diff, unsplit): `fn` as a function of x and the differentiated leaves of the explicit
    arguments only (the frozen ones and the hoisted constants are closed over), those leaves, and
    unsplit(d_diff) -> the cotangents of the explicit arguments (None where not differentiated)."""
    split = len(args) - n_consts
    explicit, consts = args[:split], args[split:]
    leaves, tree = jax.tree.flatten(explicit)
    # one mark per leaf, read at the leaves' positions: an argument's None entries (a mixed 4-bit linear's absent
    # dense or 4-bit part) are no leaves, but None in `flags` too
    marks = tree.flatten_up_to(tuple(flags[:split]))
    wanted = [i for i, mark in enumerate(marks) if mark == ()]

    def layer(x, diff):
        full = list(leaves)
        for i, leaf in zip(wanted, diff):
            full[i] = leaf
        return fn(x, *jax.tree.unflatten(tree, full), *consts)

    def unsplit(d_diff):
        d_leaves: list = [None] * len(leaves)
        for i, g in zip(wanted, d_diff):
            d_leaves[i] = g
        return jax.tree.unflatten(tree, d_leaves)

    return layer, [leaves[i] for i in wanted], unsplit


def _vjp(layer, x, x_differentiated: bool, diff):
    """(y, vjp) with vjp(dy) -> (dx or None, d_diff). The layer input is not differentiated for layer 0 (the
    frozen embedding's output): then it is closed over."""
    if x_differentiated:
        return jax.vjp(layer, x, diff)
    y, vjp = jax.vjp(lambda diff: layer(x, diff), diff)
    return y, jax.tree_util.Partial(_no_dx, vjp)


def _no_dx(vjp, dy):
    (d_diff,) = vjp(dy)
    return None, d_diff


def _cotangents(vjp, dy, unsplit, n_consts, signal):
    dx, d_diff = vjp(dy)
    # This layer's weight gradients are finished before its input cotangent leaves it. Without this barrier the
    # scheduler may defer every layer's LoRA weight-gradient matmuls to the end of the unrolled program (they are
    # only needed by the stacked gradient at the root), and their operands - this layer's recomputed activations -
    # stay live through the backward of every layer below: the device temp of no remat at all. Only
    # differentiated leaves are in it: a barrier keeps all its operands, so a frozen weight's
    # cotangent in it would be computed (it is dead code otherwise).
    dx, d_diff = jax.lax.optimization_barrier((dx, d_diff))
    return (dx, signal, *unsplit(d_diff), *([None] * n_consts))


def _policy_fwd(fn, n_consts, policy, x, x_perturbed, args, flags):
    """The forward under a checkpoint policy: the residuals are those of the vjp of the checkpointed layer (what
    the policy saves on the device, the host copies of what it offloads), returned through a barrier with y."""
    layer, diff, _ = _differentiated(fn, n_consts, args, flags)
    y, vjp = _vjp(jax.checkpoint(layer, policy=policy), x, x_perturbed, diff)
    leaves, tree = jax.tree.flatten(vjp)
    leaves, y = jax.lax.optimization_barrier((leaves, y))
    return y, (jax.tree.unflatten(tree, leaves), args, flags)


def _policy_bwd(n_consts, res, dy, above, below):
    """The residuals the policy offloaded are copied back here (`_copied_back`; the vjp's own copy back of a value
    already on the device is none), the ones it saved on the device are read in place."""
    vjp, args, flags = res
    leaves, tree = jax.tree.flatten(vjp)
    leaves, dy = _copied_back(leaves, above, dy)
    _, _, unsplit = _differentiated(None, n_consts, args, flags)
    return _cotangents(jax.tree.unflatten(tree, leaves), dy, unsplit, n_consts, below)


def _instantiate(t):
    return jnp.zeros(t.shape, t.dtype) if isinstance(t, SymbolicZero) else t


_offloaded.defvjp(_offloaded_fwd, _offloaded_bwd, symbolic_zeros=True)


def layer_index(index) -> jax.Array:
    """A layer index as an int32 array (a custom_vjp differentiates its arguments: a Python int is not one)."""
    return jnp.asarray(index, jnp.int32)
