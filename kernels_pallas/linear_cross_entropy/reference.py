"""Naive linear cross-entropy: the definition the fused implementations match.

For token ``i`` with hidden state ``h_i`` (row of ``hidden [N, H]``), target
``t_i`` and weight ``w_i``:

    x_i   = h_i @ W                      (fp32 accumulation, [V])
    z_i   = cap * tanh(x_i / cap)        (only when a logit soft-cap is set)
    CE_i  = logsumexp_j(z_ij) - z_i,t_i
    loss  = sum_i w_i * CE_i             (fp32 scalar)

Targets are clipped into ``[0, V)`` before the gather, so tokens with weight 0
may carry any target value (e.g. -100) without producing NaN.

This materialises the full ``[N, V]`` fp32 logits (and, under ``jax.grad``,
the same-sized softmax); it exists as the test oracle and the benchmark
baseline, not for training.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def linear_cross_entropy_reference(
    hidden: jax.Array,
    weight: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    *,
    logit_softcap: float | None = None,
    weight_layout: str = "hv",
) -> jax.Array:
    """Weighted sum of token cross-entropies, computed from full logits.

    Args:
      hidden: ``[N, H]`` hidden states (bf16 or fp32).
      weight: ``[H, V]`` output projection, or ``[V, H]`` (an embedding table) with
        ``weight_layout="vh"``.
      targets: ``[N]`` int target ids.
      weights: ``[N]`` per-token weights (0 = ignored).
      logit_softcap: optional ``cap``; logits become ``cap * tanh(x / cap)``.

    Returns:
      fp32 scalar ``sum_i weights_i * CE_i``.
    """
    logits = lax.dot_general(
        hidden,
        weight,
        (((1,), (0 if weight_layout == "hv" else 1,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    if logit_softcap is not None:
        logits = logit_softcap * jnp.tanh(logits / logit_softcap)
    lse = jax.nn.logsumexp(logits, axis=-1)
    safe_targets = jnp.clip(targets, 0, logits.shape[1] - 1)
    target_logits = jnp.take_along_axis(logits, safe_targets[:, None], axis=-1)[:, 0]
    return jnp.sum(weights.astype(jnp.float32) * (lse - target_logits))
