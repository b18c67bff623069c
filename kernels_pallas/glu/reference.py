"""SwiGLU gate as transformers computes it in the MLP: h = silu(gate) * up, each op rounded to the input
dtype (silu(g) = g * sigmoid(g), evaluated in fp32 and cast, then the product in the input dtype)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def swiglu_reference(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype) * up
