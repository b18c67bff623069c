"""Public entry point: out = gmm(lhs, rhs, group_sizes), see reference.py; and the op's registry ``OP`` (names as
in kernels_pallas/_dispatch.py: "xla" = ``jax.lax.ragged_dot``, "reference" = the masked dense definition).

"xla" is XLA's native ragged dot: its transpose rules are the gradients of reference.py (d lhs is a ragged
dot against rhs^T, d rhs a ragged-contracting dot giving one [K, N] block per group), so it needs no custom
VJP of its own. "pallas_mosaic" is the Hopper kernels of mosaic_kernels.py (forward, d lhs, d rhs; tiles in
tiles.py) under mosaic.py's custom VJP; natively only on CUDA devices of compute capability 9.x, in Mosaic GPU's
interpreter on CPU (tests).

"auto" (the default, what the MoE blocks use) takes "pallas_mosaic" on a Hopper GPU (compute capability 9.x)
for bf16/f16 operands and "xla" everywhere else (float32 keeps ragged_dot's numerics; CPU numerics unchanged).
On the four MoE expert shapes the kernels' forward is 16-61x `lax.ragged_dot` (tests/test_grouped_matmul_gpu.py
checks them on the GPU). Under a mesh that shards the experts, the Mosaic custom call is not
partitioned by XLA (its operands are gathered): choose "xla" by name there (the MoE blocks take the name from
``ExecutionConfig.grouped_matmul_implementation``, the ``jaxft-train`` key of the same name).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas._dispatch import ALL_PLATFORMS, AUTO, GPU_PLATFORMS, Implementation, Op

from .mosaic import grouped_matmul_mosaic
from .reference import grouped_matmul_reference

_WHERE = "kernels_pallas/grouped_matmul/api.py"


def grouped_matmul_xla(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype=None) -> jax.Array:
    return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), preferred_element_type=out_dtype)


def is_hopper(device) -> bool:
    """A CUDA device of compute capability 9.x (H100/H200): what the wgmma/TMA kernels are written for."""
    return str(getattr(device, "compute_capability", "")).startswith("9.")


_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

OP = Op(
    name="grouped_matmul",
    where=_WHERE,
    implementations=(
        Implementation("reference", grouped_matmul_reference, ALL_PLATFORMS,
                       summary="every row times every group, masked (G x the FLOPs)"),
        Implementation("xla", grouped_matmul_xla, ALL_PLATFORMS, summary="jax.lax.ragged_dot"),
        Implementation("pallas_mosaic", grouped_matmul_mosaic, GPU_PLATFORMS, interpret_platforms=("cpu",),
                       summary="Mosaic GPU wgmma kernels (Hopper), custom VJP", device_check=is_hopper),
    ),
    auto_order=("pallas_mosaic", "xla", "reference"),
)
GPU_FIRST = OP.auto_order  # "pallas_mosaic" where supported (Hopper), else ragged_dot
IMPLEMENTATIONS = OP.accepted


def implementation_for(implementation: str | None, dtype, device=None) -> str:
    """The canonical name of what ``grouped_matmul(..., implementation=)`` runs for operands of ``dtype`` on
    ``device`` (None: the default device): an explicit name as given (alias resolved), "auto"/None per the
    module docstring. What the benchmarks record as the implementation that ran."""
    impl = OP.resolve(implementation, device)
    if OP.canonical(implementation) == AUTO and impl.name == "pallas_mosaic" and \
            jnp.dtype(dtype) not in _KERNEL_DTYPES:
        return "xla"  # the kernels are bf16/f16 only (wgmma); float32 keeps ragged_dot's numerics
    return impl.name


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   implementation: str | None = AUTO, row=None, lora=None, adapter=None) -> jax.Array:
    """out[m] = lhs[m] @ rhs[g(m)] for lhs [M, K] sorted by group, rhs [G, K, N], group_sizes [G] (int);
    rows past sum(group_sizes) are 0. "xla": lax.ragged_dot; "reference": masked dense; "pallas_mosaic": the
    Mosaic GPU kernels (bf16/f16; Mosaic GPU's interpreter off the GPU); "auto"/None: "pallas_mosaic" on Hopper
    for bf16/f16, else "xla" (module docstring, `implementation_for`).

    With `row` (an int scalar, traced or not) rhs is a stack [L, G, K, N] and the product is with rhs[row]: the
    Mosaic kernels read that row of the stack in place (a layer scan's slice of a stack would be copied out
    whole before a custom call), the others slice it (XLA fuses the slice into its own ops).

    With `lora` = (xa [M, r], b [G, r, N]) (an expert adapter's factors: xa the rows' product with A, b the scaled
    B) the result is gmm(lhs, rhs) + gmm(xa, b), summed in float32 and rounded once. The Mosaic kernels add the
    adapter's product in their accumulator (one more contraction step of r per output tile), so the [M, N] product
    of the adapter is never written and read back; the others compute both products in float32 and add them.

    With `adapter` = (a [G, K, r], b [G, r, N]) (an adapter whose A side reads these rows: the experts' down
    projection) the result is gmm(lhs, rhs) + gmm(gmm(lhs, a), b): `lora` with xa = gmm(lhs, a). The Mosaic kernels
    also fuse the backward's d xa @ a^T into the d lhs kernel (`mosaic._gmm_adapted`)."""
    impl = OP.get(implementation_for(implementation, lhs.dtype))
    stacked = row is not None
    if lhs.ndim != 2 or rhs.ndim != 3 + stacked or lhs.shape[1] != rhs.shape[-2]:
        want = "[L, G, K, N] (with row=)" if stacked else "[G, K, N]"
        raise ValueError(f"{_WHERE}: grouped_matmul needs lhs [M, K] and rhs {want}, got lhs {lhs.shape} and "
                         f"rhs {rhs.shape}")
    if group_sizes.shape != (rhs.shape[-3],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{_WHERE}: group_sizes must be integers of shape ({rhs.shape[-3]},) (one per rhs group), "
                         f"got {group_sizes.dtype} {group_sizes.shape}")
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"{_WHERE}: lhs {lhs.dtype} and rhs {rhs.dtype} must have the same dtype; cast one")
    if lora is not None and adapter is not None:
        raise ValueError(f"{_WHERE}: grouped_matmul takes lora=(xa, b) or adapter=(a, b), not both")
    if adapter is not None:
        _check_adapter(adapter, lhs, rhs)
    if lora is not None:
        _check_lora(lora, lhs, rhs)
    if impl.name == "pallas_mosaic":
        return impl.fn(lhs, rhs, group_sizes, row=row, lora=lora, adapter=adapter)
    if stacked:
        rhs = jax.lax.dynamic_index_in_dim(rhs, row, 0, keepdims=False)
    if adapter is not None:
        a, b = adapter
        lora = (impl.fn(lhs, a, group_sizes), b)
    if lora is None:
        return impl.fn(lhs, rhs, group_sizes)
    xa, b = lora
    return (impl.fn(lhs, rhs, group_sizes, jnp.float32) + impl.fn(xa, b, group_sizes, jnp.float32)).astype(lhs.dtype)


def _check_lora(lora, lhs: jax.Array, rhs: jax.Array) -> None:
    xa, b = lora
    if xa.ndim != 2 or b.ndim != 3 or xa.shape[0] != lhs.shape[0] or b.shape != (rhs.shape[-3], xa.shape[1],
                                                                                   rhs.shape[-1]):
        raise ValueError(f"{_WHERE}: lora=(xa, b) needs xa [M, r] and b [G, r, N] beside lhs {lhs.shape} and rhs "
                         f"{rhs.shape}, got xa {xa.shape} and b {b.shape}")
    if xa.dtype != lhs.dtype or b.dtype != lhs.dtype:
        raise ValueError(f"{_WHERE}: lora=(xa, b) must have lhs's dtype {lhs.dtype}, got {xa.dtype} and {b.dtype}; "
                         f"cast them")


def _check_adapter(adapter, lhs: jax.Array, rhs: jax.Array) -> None:
    a, b = adapter
    g, k, n = rhs.shape[-3:]
    if a.ndim != 3 or b.ndim != 3 or a.shape[:2] != (g, k) or b.shape != (g, a.shape[2], n):
        raise ValueError(f"{_WHERE}: adapter=(a, b) needs a [G, K, r] and b [G, r, N] beside lhs {lhs.shape} and rhs "
                         f"{rhs.shape}, got a {a.shape} and b {b.shape}")
    if a.dtype != lhs.dtype or b.dtype != lhs.dtype:
        raise ValueError(f"{_WHERE}: adapter=(a, b) must have lhs's dtype {lhs.dtype}, got {a.dtype} and {b.dtype}; "
                         f"cast them")
