"""Public entry point: out = gmm(lhs, rhs, group_sizes), see reference.py; and the op's registry ``OP`` (names as
in kernels_pallas/_dispatch.py: "xla" = ``jax.lax.ragged_dot``, "reference" = the masked dense definition).

"xla" is XLA's native ragged dot: its transpose rules are the gradients of reference.py (d lhs is a ragged
dot against rhs^T, d rhs a ragged-contracting dot giving one [K, N] block per group), so it needs no custom
VJP of its own. A Mosaic GPU kernel will register here as "pallas_mosaic".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas._dispatch import ALL_PLATFORMS, Implementation, Op

from .reference import grouped_matmul_reference

_WHERE = "kernels_pallas/grouped_matmul/api.py"


def grouped_matmul_xla(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32))


OP = Op(
    name="grouped_matmul",
    where=_WHERE,
    implementations=(
        Implementation("reference", grouped_matmul_reference, ALL_PLATFORMS,
                       summary="every row times every group, masked (G x the FLOPs)"),
        Implementation("xla", grouped_matmul_xla, ALL_PLATFORMS, summary="jax.lax.ragged_dot"),
    ),
    auto_order=("xla", "reference"),
)
IMPLEMENTATIONS = OP.accepted


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   implementation: str | None = "xla") -> jax.Array:
    """out[m] = lhs[m] @ rhs[g(m)] for lhs [M, K] sorted by group, rhs [G, K, N], group_sizes [G] (int);
    rows past sum(group_sizes) are 0. "xla": lax.ragged_dot; "reference": masked dense; "auto"/None: "xla"."""
    impl = OP.resolve(implementation)
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"{_WHERE}: grouped_matmul needs lhs [M, K] and rhs [G, K, N], got lhs {lhs.shape} and "
                         f"rhs {rhs.shape}")
    if group_sizes.shape != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{_WHERE}: group_sizes must be integers of shape ({rhs.shape[0]},) (one per rhs group), "
                         f"got {group_sizes.dtype} {group_sizes.shape}")
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"{_WHERE}: lhs {lhs.dtype} and rhs {rhs.dtype} must have the same dtype; cast one")
    return impl.fn(lhs, rhs, group_sizes)
