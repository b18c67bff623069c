"""The FP8-stored matmul on FP8 tensor cores: both GEMMs of a frozen linear in float8_e4m3fn with float32
accumulation (XLA turns an f8 x f8 dot into cuBLASLt's FP8 GEMM, `__cublas$lt$matmul$f8`, on compute capability
8.9 and up; elsewhere it upcasts, which makes this a test vehicle on the CPU).

Every scale is per row or per column of a GEMM's output, so it factors out of the contraction exactly:

    forward   q_x, s_x = quantize_rows(x)                       (s_x per token)
              y  = (q_x @ q_w^T) * s_x[:, None] * s_w[None, :]                   -> x's dtype
    backward  dy' = dy * s_w[None, :]                            (W's output scale folded into dy, fp32)
              q_g, s_g = quantize_rows(dy')                      (s_g per token)
              dx = (q_g @ q_w) * s_g[:, None]                                    -> dy's dtype

Each GEMM accumulates in fp32 and writes the compute dtype; the scales are applied in fp32.

The output gradient is rounded to e4m3 too (per-token scales leave its 3 mantissa bits, not its range, as the
limit; cuBLASLt takes e4m3 x e4m3). The weight gets no gradient; the residuals are its codes and scales alone.
The backward contracts over q_w's rows, so XLA transposes the FP8 weight (1 byte a value) for cuBLASLt, whose FP8
GEMMs take K-major operands only; the forward needs no transpose ([out, in] is K-major already).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .reference import quantize_rows

SCOPE = "fp8_matmul"  # the name the forward and backward GEMMs carry in the compiled program's metadata


def _gemm(q_a: jax.Array, q_b: jax.Array, b_contract: int, dtype) -> jax.Array:
    """q_a [m, k] times q_b (its dim `b_contract` of size k), accumulated in float32, written in `dtype` (the
    compute dtype: a bf16 result halves the GEMM's output traffic and the transient, at one bf16 rounding before
    the scales, far below e4m3's)."""
    return jax.lax.dot_general(q_a, q_b, (((1,), (b_contract,)), ((), ())), preferred_element_type=dtype)


def forward(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """y = x W^T through the FP8 GEMM (the module docstring's forward), in x's dtype."""
    with jax.named_scope(SCOPE):
        rows = x.reshape(-1, x.shape[-1])
        q_x, s_x = quantize_rows(rows)
        y = _gemm(q_x, q, 1, x.dtype).astype(jnp.float32) * s_x[:, None] * scale[None, :].astype(jnp.float32)
        return y.astype(x.dtype).reshape(*x.shape[:-1], q.shape[0])


def input_gradient(dy: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """dx = dy W through the FP8 GEMM (the module docstring's backward), in dy's dtype."""
    with jax.named_scope(SCOPE + "_dx"):
        rows = dy.reshape(-1, dy.shape[-1]).astype(jnp.float32) * scale[None, :].astype(jnp.float32)
        q_g, s_g = quantize_rows(rows)
        dx = _gemm(q_g, q, 0, dy.dtype).astype(jnp.float32) * s_g[:, None]
        return dx.astype(dy.dtype).reshape(*dy.shape[:-1], q.shape[1])


@jax.custom_vjp
def _matmul(x, q, scale):
    return forward(x, q, scale)


def _fwd(x, q, scale):
    return forward(x, q, scale), (q, scale)


def _bwd(residuals, dy):
    q, scale = residuals
    return input_gradient(dy, q, scale), None, None


_matmul.defvjp(_fwd, _bwd)


def fp8_matmul_fp8(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """y = x W^T, forward and input gradient as FP8 GEMMs (see the module docstring)."""
    return _matmul(x, q, scale)
