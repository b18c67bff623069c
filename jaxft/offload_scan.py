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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxft.offload import _hoist_constants

Space = jax.memory.Space


def offloaded_scan(fs, carry, xs):
    """`jax.lax.scan` of one iteration = `fs` applied in order (a callable or a sequence of them: the layers of one
    period of a periodic stack, each `f(c, x) -> c` on the same scanned slice x), returning the last carry, with
    the backward of full remat whose layer inputs (the carry before each f) wait in pinned host memory and come
    back one layer early (module docstring). Each f may close over traced values (hoisted as constants, never
    differentiated)."""
    fs = (fs,) if callable(fs) else tuple(fs)
    x0 = jax.tree.map(lambda leaf: leaf[0], xs)
    converted, consts = [], []
    for f in fs:
        g, c = _hoist_constants(f, carry, x0)
        converted.append((g, len(consts), len(c)))
        consts += c  # every f maps the carry to a carry of the same structure (a scan's)
    return _scan(tuple(converted), carry, xs, *consts)


def _apply(f, c, x, consts):
    g, start, count = f
    return g(c, x, *consts[start:start + count])


def _host(leaf) -> bool:
    """Whether a carry leaf waits on the host: the activations (rank >= 2), not small accumulators."""
    return jnp.ndim(leaf) >= 2


def _to(leaf, space):
    # On the CPU JAX lowers no placement: both copies are identities there (as in jaxft.offload).
    return jax.device_put(leaf, space)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan(fs, carry, xs, *consts):
    def body(c, x):
        for f in fs:
            c = _apply(f, c, x, consts)
        return c, None

    return jax.lax.scan(body, carry, xs)[0]


def _scan_fwd(fs, carry, xs, *consts):
    flags = jax.tree.map(lambda p: () if p.perturbed else None, (carry, xs, consts))
    carry, xs, consts = jax.tree.map(lambda p: p.value, (carry, xs, consts))

    def body(c, x):
        kept = []
        for f in fs:
            kept.append(jax.tree.map(lambda leaf: _to(leaf, Space.Host) if _host(leaf) else leaf, c))
            c = _apply(f, c, x, consts)
        return c, kept

    out, kept = jax.lax.scan(body, carry, xs)
    return out, (kept, xs, consts, flags)


def _scan_bwd(fs, res, g_out):
    kept, xs, consts, (carry_flags, xs_flags, const_flags) = res
    g_out = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype) if isinstance(t, SymbolicZero) else t, g_out,
                         is_leaf=lambda t: isinstance(t, SymbolicZero))
    n, p = jax.tree.leaves(xs)[0].shape[0], len(fs)
    x_leaves, x_tree = jax.tree.flatten(xs)
    is_flag = lambda t: t is None or t == ()  # noqa: E731
    x_want = [i for i, m in enumerate(jax.tree.leaves(xs_flags, is_leaf=is_flag)) if m == ()]
    c_want = [i for i, m in enumerate(jax.tree.leaves(const_flags, is_leaf=is_flag)) if m == ()]
    carry_wanted = any(m == () for m in jax.tree.leaves(carry_flags, is_leaf=is_flag))

    def call(f, c, x_all, x_diff, c_diff):
        """f on the full inputs with the differentiated leaves replaced by `x_diff` / `c_diff`."""
        xl, cl = list(x_all), list(consts)
        for i, v in zip(x_want, x_diff):
            xl[i] = v
        for i, v in zip(c_want, c_diff):
            cl[i] = v
        return _apply(f, c, jax.tree.unflatten(x_tree, xl), cl)

    def input_of(i, j):
        """The carry before f_j of iteration i, copied back to the device (started here, used later)."""
        return jax.tree.map(lambda leaf: _to(jax.lax.dynamic_index_in_dim(leaf, i, keepdims=False), Space.Device)
                            if _host(leaf) else jax.lax.dynamic_index_in_dim(leaf, i, keepdims=False), kept[j])

    def body(state, inputs):
        g, cur, acc = state
        x_all, i = inputs
        x_diff = [x_all[j] for j in x_want]
        c_diff = [consts[j] for j in c_want]
        gx = [jnp.zeros_like(v) for v in x_diff]
        for j in reversed(range(p)):
            # The prefetch of the layer below: its copy back runs under this layer's recompute and backward.
            below = input_of(jnp.maximum(i - 1, 0), p - 1) if j == 0 else input_of(i, j - 1)
            _, vjp = jax.vjp(lambda c, xd, cd, f=fs[j]: call(f, c, x_all, xd, cd), cur, x_diff, c_diff)
            g, gxj, gcj = vjp(g)
            gx = [a + b for a, b in zip(gx, gxj)]
            acc = [a + b for a, b in zip(acc, gcj)]
            cur = below
        return (g, cur, acc), gx

    zeros_c = [jnp.zeros_like(consts[i]) for i in c_want]
    (g0, _, g_consts), g_xs = jax.lax.scan(body, (g_out, input_of(n - 1, p - 1), zeros_c),
                                           (x_leaves, jnp.arange(n, dtype=jnp.int32)), reverse=True)
    dx = [None] * len(x_leaves)
    for i, g in zip(x_want, g_xs):
        dx[i] = g
    dc = [None] * len(consts)
    for i, g in zip(c_want, g_consts):
        dc[i] = g
    return (g0 if carry_wanted else None, jax.tree.unflatten(x_tree, dx), *dc)


_scan.defvjp(_scan_fwd, _scan_bwd, symbolic_zeros=True)
