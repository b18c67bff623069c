"""Helpers for the Pallas kernels on the Triton backend (attention/flash.py)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def dot_f32(a, b, contract_a: int, contract_b: int):
    """2-D matmul with float32 accumulation, contracting dimension `contract_a` of a with `contract_b` of b."""
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32)
