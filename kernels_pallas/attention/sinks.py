"""Attention sinks as an exact correction of an attention WITHOUT sinks: so cuDNN's kernels serve GPT-OSS.

A sink is one extra logit s_h per head in every row's softmax whose probability is dropped (reference.py):

    o_sink[t] = sum_u e^{x_tu} v_u / (Z_t + e^{s_h}),   Z_t = sum_u e^{x_tu} = e^{lse_t}
             = g_t * o[t],                             g_t = Z_t / (Z_t + e^{s_h}) = sigmoid(lse_t - s_h)

with o and lse the output and log-sum-exp of the same attention without the sink. So any attention that
returns (o, lse) gives the sink output with one elementwise product. The gradient, for a loss with cotangent
dO of o_sink, p_tu = e^{x_tu} / Z_t the sink-free probabilities and pi_tu = g_t p_tu the sink's:

    d x_tu = pi_tu (dO_t . v_u - dO_t . o_sink_t) = p_tu ((g_t dO_t) . v_u - (g_t dO_t) . o_sink_t)
    d v_u  = sum_t pi_tu dO_t = sum_t p_tu (g_t dO_t)
    d s_h  = sum_t dO_t . d o_sink_t / d s_h = - sum_{b, t} (dO_t . o_sink_t) (1 - g_t)

The first two are EXACTLY a flash-attention backward (P from the saved lse, dP = dO' V^T, D = rowsum(dO' * O'),
dS = P (dP - D)) run with dO' = g dO and O' = o_sink in place of its own output: so the sink-free backward
kernel, fed those two tensors and the saved lse, returns dq, dk, dv of the attention with sinks; d s is one
reduction. Nothing is approximated: the forward's rounding is one product of o by g (fp32), the backward's is
the kernel's own.

`sink_attention(fwd_lse, bwd)` builds that custom VJP from a pair:
    fwd_lse(q, k, v) -> (o [B, T, H, D], lse [B, H, T] fp32)      (the attention without sinks)
    bwd(q, k, v, o, lse, do) -> (dq, dk, dv)                       (its flash backward, taking O and dO)
The residuals are named as the other attention ops' (`residuals.py`: the output, and the lse as statistics), so
remat policies that keep them never re-run the forward. Pairs: `reference_pair` (pure JAX, the CPU tests'
oracle of this algebra), `kernels_pallas.attention.cudnn.cudnn_pair` (cuDNN's forward with its softmax
statistics and its backward kernel), `kernels_pallas.attention.flash.flash_pair` (the Pallas kernels) and
`kernels_pallas.attention.api.dense_or_packed_pair` (one of the last two, chosen on the device per batch). With
sinks=None the same custom VJP is the pair's own attention with named residuals.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from kernels_pallas.attention.reference import masked_scores
from kernels_pallas.attention.residuals import name_output, name_stats


def _gate(lse: jax.Array, sinks: jax.Array) -> jax.Array:
    """g = sigmoid(lse - s) [B, H, T] -> [B, T, H, 1] fp32, to scale o / dO laid out [B, T, H, D]."""
    g = jax.nn.sigmoid(lse.astype(jnp.float32) - sinks.astype(jnp.float32)[None, :, None])
    return jnp.swapaxes(g, 1, 2)[..., None]


def sink_attention(fwd_lse: Callable, bwd: Callable) -> Callable:
    """attend(q, k, v, sinks, *extras) -> o_sink [B, T, H, D] in q's dtype, from a sink-free (forward with lse,
    backward) pair (module docstring). sinks [H] are differentiated; q, k, v as the pair's backward gives.
    sinks may be None: the pair's own attention, with its residuals named. `extras` (integer arrays the pair
    reads and is not differentiated in: a branch predicate, block metadata) go to both as last arguments,
    fwd_lse(q, k, v, *extras) and bwd(q, k, v, o, lse, do, *extras); a custom VJP may not close over a traced
    value of an enclosing transformation, so they cannot be captured."""

    @jax.custom_vjp
    def attend(q, k, v, sinks, *extras):
        return _forward(q, k, v, sinks, extras)[0]

    def _forward(q, k, v, sinks, extras):
        o, lse = fwd_lse(q, k, v, *extras)
        if sinks is not None:
            o = (o.astype(jnp.float32) * _gate(lse, sinks)).astype(q.dtype)
        return name_output(o), name_stats(lse)

    def fwd(q, k, v, sinks, *extras):
        out, lse = _forward(q, k, v, sinks, extras)
        return out, (q, k, v, sinks, out, lse, extras)

    def backward(res, do):
        q, k, v, sinks, out, lse, extras = res
        none = jax.tree.map(lambda _: None, extras)  # integer inputs: no cotangent
        if sinks is None:
            return (*bwd(q, k, v, out, lse, do, *extras), None, *none)
        g = _gate(lse, sinks)
        dq, dk, dv = bwd(q, k, v, out, lse, (do.astype(jnp.float32) * g).astype(do.dtype), *extras)
        row = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # dO . o_sink  [B, T, H]
        dsinks = -jnp.sum(row * (1.0 - g[..., 0]), axis=(0, 1))
        return dq, dk, dv, dsinks.astype(sinks.dtype), *none

    attend.defvjp(fwd, backward)
    return attend


# ------------------------------------------------------------------------------- the pure-JAX pair (oracle)
def reference_pair(*, causal: bool, sliding_window: int | None, scale: float):
    """(fwd_lse, bwd) in plain JAX on single-segment rows: the forward returns the natural-log log-sum-exp
    [B, H, T] as cuDNN's statistics; the backward is the flash backward formula from (O, dO, lse), not
    autodiff, so a test of `sink_attention` on it checks the algebra the cuDNN pair relies on."""

    def fwd_lse(q, k, v):
        b, t, h, d = q.shape
        s, _ = masked_scores(q, k, causal=causal, sliding_window=sliding_window, scale=scale)
        lse = jax.nn.logsumexp(s, axis=-1)  # [B, KV, G, T]
        p = jnp.exp(s - lse[..., None])
        o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32)).reshape(b, t, h, d)
        return o.astype(q.dtype), lse.reshape(b, h, t)

    def bwd(q, k, v, o, lse, do):
        b, t, h, d = q.shape
        kvh = k.shape[2]
        s, qg = masked_scores(q, k, causal=causal, sliding_window=sliding_window, scale=scale)
        p = jnp.exp(s - lse.reshape(b, kvh, h // kvh, t)[..., None])
        dog = do.astype(jnp.float32).reshape(b, t, kvh, h // kvh, d)
        dp = jnp.einsum("btkgd,bskd->bkgts", dog, v.astype(jnp.float32))
        delta = jnp.einsum("btkgd,btkgd->bkgt", dog, o.astype(jnp.float32).reshape(dog.shape))
        ds = p * (dp - delta[..., None]) * jnp.float32(scale)
        dq = jnp.einsum("bkgts,bskd->btkgd", ds, k.astype(jnp.float32)).reshape(q.shape)
        dk = jnp.einsum("bkgts,btkgd->bskd", ds, qg.astype(jnp.float32))
        dv = jnp.einsum("bkgts,btkgd->bskd", p, dog)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    return fwd_lse, bwd
