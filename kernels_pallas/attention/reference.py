"""Pure-JAX reference attention (the ``implementation="reference"`` path; "xla" is its old alias).

Math, for one batch row b, query token t and head h (KV head kv = h // G with
G = H // KV query heads per KV head):

    s[t, u]  = scale * <q[t, h], k[u, kv]>                     (fp32)
    s[t, u]  = cap * tanh(s[t, u] / cap)           if logit_softcap (after scaling, before mask)
    s[t, u]  = -inf   unless  keep(t, u)
    keep(t, u) = seg[t] == seg[u]
                 and (not causal or u <= t)
                 and (window is None or t - u < window)
    s_sink   = sinks[h]                             if sinks: one extra logit column
    p        = softmax([s[t, :], s_sink])           (fp32; the sink's probability is dropped)
    o[t, h]  = sum_u p[t, u] * v[u, kv]

GQA is done by reshaping q to [B, T, KV, G, D]; K and V are never repeated.
The full [T, T] score matrix is materialised, so this path is O(T^2) memory:
it is the oracle for the kernels and a fallback, not a fast path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite "minus infinity": keeps fully-masked rows NaN-free (they cannot occur
# under the segment contract, but padding introduced by callers might).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array,
    *,
    causal: bool,
    sliding_window: int | None,
    q_offset: int = 0,
) -> jax.Array:
    """Boolean keep-mask [B, Tq, Tk]: equal segment id, causal, left window.

    ``q_offset`` is the absolute position of query 0 relative to key 0.
    """
    tq = q_segment_ids.shape[-1]
    tk = kv_segment_ids.shape[-1]
    keep = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    qi = jnp.arange(tq, dtype=jnp.int32)[:, None] + q_offset
    ki = jnp.arange(tk, dtype=jnp.int32)[None, :]
    diff = qi - ki
    if causal:
        keep = keep & (diff >= 0)[None]
    if sliding_window is not None:
        keep = keep & (diff < sliding_window)[None]
    return keep


def masked_scores(q, k, *, segment_ids=None, causal=True, sliding_window=None, logit_softcap=None,
                  scale=None):
    """(scores [B, KV, G, T, S] fp32, q split for GQA [B, T, KV, G, D]): scaled, soft-capped and masked
    (MASK_VALUE where keep(t, u) is false) as the module docstring defines them."""
    b, t, h, d = q.shape
    s_len, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    if scale is None:
        scale = d ** -0.5
    qg = q.reshape(b, t, kvh, g, d)
    scores = jnp.einsum(
        "btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32
    ) * jnp.float32(scale)
    if logit_softcap is not None:
        cap = jnp.float32(logit_softcap)
        scores = cap * jnp.tanh(scores / cap)
    if segment_ids is None:
        q_seg = jnp.ones((b, t), jnp.int32)
        k_seg = jnp.ones((b, s_len), jnp.int32)
    else:
        q_seg = k_seg = segment_ids.astype(jnp.int32)
    keep = attention_mask(q_seg, k_seg, causal=causal, sliding_window=sliding_window)
    return jnp.where(keep[:, None, None], scores, MASK_VALUE), qg


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Reference attention. q [B,T,H,D], k/v [B,S,KV,D] -> [B,T,H,D] in q.dtype.

    Scores, softmax and the P@V product are all computed in fp32.
    Differentiable with plain autodiff (used as the gradient oracle in tests).
    """
    b, t, h, d = q.shape
    kvh, g = k.shape[2], h // k.shape[2]
    scores, _ = masked_scores(q, k, segment_ids=segment_ids, causal=causal, sliding_window=sliding_window,
                              logit_softcap=logit_softcap, scale=scale)
    if sinks is not None:
        sink_col = jnp.broadcast_to(
            sinks.astype(jnp.float32).reshape(1, kvh, g, 1, 1), (b, kvh, g, t, 1)
        )
        scores = jnp.concatenate([scores, sink_col], axis=-1)
    probs = jax.nn.softmax(scores, axis=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    out = jnp.einsum(
        "bkgts,bskd->btkgd", probs, v.astype(jnp.float32),
        preferred_element_type=jnp.float32,
    )
    return out.reshape(b, t, h, d).astype(q.dtype)
