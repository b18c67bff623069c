"""Grouped matmul, the definition: out[m] = lhs[m] @ rhs[g(m)], where g(m) is the group that row m falls in.

    lhs [M, K]          rows sorted by group: group 0's rows first, then group 1's, ...
    rhs [G, K, N]       one [K, N] matrix per group (an MoE expert's projection)
    group_sizes [G]     int32 row counts, sum(group_sizes) <= M; a group may be empty (size 0)
    out [M, N]          out[m] = lhs[m] @ rhs[g(m)] for m < sum(group_sizes); rows past the last group are 0

with g(m) = #{g : offsets[g + 1] <= m}, offsets = [0, cumsum(group_sizes)]. Gradients (autodiff of this
definition, and what every implementation must reproduce), with dout [M, N] and lhs_g / dout_g the rows of
group g:

    d lhs   = gmm(dout, rhs^T)              (rhs^T [G, N, K]: each row goes back through its own group)
    d rhs[g] = lhs_g^T dout_g                (a per-group [K, N] sum over that group's rows; 0 if empty)

With an adapter fused in (``grouped_matmul(..., lora=(xa, b))``): out = gmm(lhs, rhs) + gmm(xa, b), summed in
float32 and rounded once; each product's gradients are the rules above.

This reference multiplies every row by every group and masks: G times the work of the real thing, so a test
oracle and nothing more. It never reads ``group_sizes`` on the host, so it traces under jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_ids(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """g(m) for m in [0, num_rows): the group of each row; G for rows past the last group."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(num_rows, dtype=jnp.int32), side="right").astype(jnp.int32)


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype=None) -> jax.Array:
    """The definition, accumulated in float32 and returned in `out_dtype` (default: lhs's dtype)."""
    num_groups = rhs.shape[0]
    onehot = group_ids(group_sizes, lhs.shape[0])[:, None] == jnp.arange(num_groups, dtype=jnp.int32)[None, :]
    every = jnp.einsum("mk,gkn->mgn", lhs, rhs, preferred_element_type=jnp.float32)
    return jnp.sum(jnp.where(onehot[:, :, None], every, 0.0), axis=1).astype(out_dtype or lhs.dtype)
