"""Public entry point: y = x W^T for a frozen weight stored in FP8 with per-output-channel scales (reference.py),
and the op's registry ``OP`` (names as in kernels_pallas/_dispatch.py: "xla_fp8" both GEMMs on FP8 tensor cores,
"xla" dequantise-then-matmul with a re-dequantising custom VJP, "reference"). ``auto`` takes "xla_fp8" on a GPU of
compute capability 8.9 or more (Ada, Hopper and later: FP8 tensor cores) and "xla" elsewhere, so the same stored
weights run everywhere."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas._dispatch import ALL_PLATFORMS, GPU_PLATFORMS, Implementation, Op

from .fp8 import fp8_matmul_fp8
from .reference import E4M3, fp8_matmul_reference
from .xla import fp8_matmul_dequant

_WHERE = "kernels_pallas/fp8_matmul/api.py"


def has_fp8_tensor_cores(device) -> bool:
    """A CUDA device of compute capability 8.9 or more (cuBLASLt's FP8 GEMMs)."""
    cc = str(getattr(device, "compute_capability", ""))
    try:
        major, minor = (int(p) for p in cc.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (8, 9)


OP = Op(name="fp8_matmul", where=_WHERE, implementations=(
    Implementation("reference", fp8_matmul_reference, ALL_PLATFORMS, summary="autodiff of the definition"),
    Implementation("xla", fp8_matmul_dequant, ALL_PLATFORMS,
                   summary="dequantise-then-matmul in the compute dtype, custom VJP re-dequantising in the backward"),
    Implementation("xla_fp8", fp8_matmul_fp8, GPU_PLATFORMS, interpret_platforms=("cpu",),
                   device_check=has_fp8_tensor_cores,
                   summary="forward and input gradient as FP8 GEMMs (per-token and per-channel scales, fp32 "
                           "accumulation), custom VJP")),
    auto_order=("xla_fp8", "xla", "reference"))
IMPLEMENTATIONS = OP.accepted


def fp8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, *, implementation: str | None = "auto") -> jax.Array:
    """x [..., in] times the FP8 weight q [out, in] (scales `scale` [out]) transposed -> [..., out] in x's dtype."""
    impl = OP.resolve(implementation)
    if q.ndim != 2 or q.dtype != jnp.dtype(E4M3):
        raise ValueError(f"{_WHERE}: q must be float8_e4m3fn [out, in], got {q.dtype} {q.shape}")
    if scale.shape != q.shape[:1]:
        raise ValueError(f"{_WHERE}: scale {scale.shape} must be [out] = {q.shape[:1]}")
    if x.shape[-1] != q.shape[1]:
        raise ValueError(f"{_WHERE}: x {x.shape} does not end in in_features={q.shape[1]} of q {q.shape}")
    return impl.fn(x, q, scale)
