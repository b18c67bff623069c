"""RMSNorm as transformers' Llama/Qwen/Mistral compute it (the op's definition; plain autodiff).

    r = rsqrt(mean(x32^2, -1) + eps)        x32 = x in fp32
    y = w * (x32 * r).astype(x.dtype)       (the product in x.dtype)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rmsnorm_reference(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def rmsnorm_offset_reference(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm, whose stored weight starts at 0: y = (x32 * r * (1 + w32)).astype(x.dtype), the
    product in fp32."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
