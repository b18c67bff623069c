"""Next-token choice from fp32 logits: greedy argmax, or temperature + nucleus (top-p) sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits: jax.Array, key: jax.Array, temperature, top_p, *, greedy: bool) -> jax.Array:
    """Token ids [B] from logits [B, V].

    greedy: argmax. Otherwise softmax(logits / temperature) restricted to the smallest set of most likely
    tokens whose probability reaches `top_p` (a token is kept when the mass of the tokens ranked above it is
    < top_p, so the most likely token always is): transformers' TopPLogitsWarper up to ties at the cut.
    `temperature` and `top_p` may be traced, so changing them does not recompile.
    """
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    ranked = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ranked, axis=-1)
    mass_above = jnp.cumsum(probs, axis=-1) - probs
    kept = mass_above < jnp.asarray(top_p, jnp.float32)
    cutoff = jnp.min(jnp.where(kept, ranked, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
