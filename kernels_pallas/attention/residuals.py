"""Named residuals of the attention ops, so a rematerialisation policy can keep them.

Under `jax.checkpoint` a custom VJP's forward rule is traced like any other code: a policy sees the
`checkpoint_name`s inside it. A residual that no policy keeps is recomputed in the backward pass, and for a
kernel that means re-running its forward. Naming the output `OUT_NAME` and the softmax statistics
`STATS_NAME` lets a policy (jaxft's "offload+attn", or `save=attn_out,attn_lse`) keep exactly those; q, k and v
are the kernel's inputs, which the model recomputes (or keeps) upstream, so the backward runs only the
attention backward kernels.

The primal output must be the named value itself (the forward returns it and stores it as a residual):
a copy named apart from the output that flows on would leave the output unnamed, and everything downstream of
it would still need the kernel forward re-run in the backward.

`named_vjp(fn)` does this for an attention function whose VJP is not ours (cuDNN through JAX): it runs
`jax.vjp(fn)` in its forward rule and names every residual leaf that is not one of its inputs: the output
itself (the same traced value) becomes the named output, every other leaf (cuDNN's softmax statistics, or any
re-laid-out copy of an input) is named `STATS_NAME`, so keeping both names never re-runs `fn`'s forward.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

OUT_NAME = "attn_out"
STATS_NAME = "attn_lse"


def name_output(o: jax.Array) -> jax.Array:
    return checkpoint_name(o, OUT_NAME)


def name_stats(s: jax.Array) -> jax.Array:
    return checkpoint_name(s, STATS_NAME)


def named_vjp(fn: Callable[..., jax.Array]):
    """`fn(q, k, v, *extras) -> o` with the same values and gradients, whose backward residuals are named (see
    the module docstring). `extras` are arrays the attention reads but is not differentiated in (segment ids):
    they must be arguments, not values `fn` closes over, because a custom VJP may not close over a traced value
    of an enclosing transformation (a layer scan's body: its tracer would leak out of the scan). Only arrays
    cross from the forward rule to the backward rule; the pullback's pytree structure, which is not an array,
    is taken from the forward's trace (a custom VJP traces its forward rule before its backward rule), one
    structure per wrapped function."""
    structure = []

    @jax.custom_vjp
    def attend(q, k, v, *extras):
        return fn(q, k, v, *extras)

    def fwd(q, k, v, *extras):
        raw, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, *extras), q, k, v)
        o = name_output(raw)
        leaves, tree = jax.tree.flatten(vjp)
        structure[:] = [(tree, len(extras))]
        leaves = [leaf if any(leaf is x for x in (q, k, v)) else o if leaf is raw else name_stats(leaf)
                  for leaf in leaves]
        return o, leaves

    def bwd(leaves, do):
        tree, extras = structure[0]
        return (*jax.tree.unflatten(tree, leaves)(do), *([None] * extras))  # no cotangent for the extras

    attend.defvjp(fwd, bwd)
    return attend
