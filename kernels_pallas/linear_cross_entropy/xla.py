"""Chunked linear cross-entropy in plain JAX/XLA with a hand-written VJP.

Math (per token ``i``; ``h_i`` row of ``hidden``, ``W = weight [H, V]``):

    x_i  = h_i @ W                                 fp32 accumulation
    z_i  = c * tanh(x_i / c)   (soft-cap c)  or  x_i
    l_i  = logsumexp_j z_ij                         saved residual, [N] fp32
    CE_i = l_i - z_i,t_i
    L    = sum_i w_i * CE_i

Gradient.  With the output cotangent ``g = dJ/dL``:

    dL/dz_ij = w_i * (softmax(z_i)_j - [j == t_i])
             = w_i * (exp(z_ij - l_i) - onehot_ij)
    dz/dx    = 1 - tanh(x / c)^2                    (1 without soft-cap)
    dx_ij    = g * w_i * (exp(z_ij - l_i) - onehot_ij) * dz/dx_ij
    dhidden  = dx @ W^T                             [N, H]
    dW       = hidden^T @ dx = sum_chunks h_c^T @ dx_c   (fp32 accumulator)
    dw_i     = g * CE_i

Weight layout.  ``W`` comes as ``[H, V]`` (``layout="hv"``: an ``lm_head`` kernel) or as ``[V, H]``
(``layout="vh"``: a tied embedding table, read in place).  Only the contraction dimensions of the three
matmuls change (``h W`` contracts H of either layout, ``dx W^T`` contracts V, ``dW`` comes out in the
weight's own layout).  Why not pass ``embedding.T``: the chunk loop is an XLA while loop, and XLA does
not fold a transpose into a dot across the loop boundary, so ``embedding.T`` became a materialised
``[H, V]`` copy, live through the loss's forward pass (1.7 GiB for Gemma 2's 256k x 3584 table,
compiled for an H200), which is the no-remat step's memory peak.

Only ``l`` (and ``CE`` when ``weights`` is differentiated) is kept between the
passes; the backward pass recomputes each chunk's logits.  The tokens are
processed in chunks of ``C`` rows, so the live logits are ``[C, V]`` instead
of ``[N, V]``.

Frozen head (``weight`` not differentiated, ``hidden`` differentiated: the LoRA case).  Then
``dhidden = g * U`` with ``U = dx(g=1) @ W^T`` independent of ``g`` (the loss is linear in the
per-token terms and ``g`` is a scalar), so the forward pass computes ``U`` chunk by chunk while the
chunk's logits are live, and the backward pass only scales it.  That saves the backward pass's
recomputation of the logits: 2 [C,H]x[H,V] matmuls per chunk in all instead of 3.  The residual is
``U [N, H]`` in ``hidden``'s dtype in place of ``hidden`` itself, so memory is unchanged.

``defvjp(..., symbolic_zeros=True)`` tells the forward rule which inputs are
differentiated (``CustomVJPPrimal.perturbed``).  The backward rule skips the
``[H, V]`` weight-gradient accumulation entirely when ``weight`` is frozen
(the usual LoRA case: frozen ``lm_head``), skips ``dhidden`` when ``hidden``
is not differentiated, and skips the chunk loop altogether when only
``weights`` is.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

_F32 = jnp.float32


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Perturbed:
    """Which inputs the caller differentiates (static residual for the bwd)."""

    hidden: bool
    weight: bool
    weights: bool


def _scan_chunks(
    body: Callable[[Any, Any, int], tuple[Any, Any]],
    init: Any,
    num_tokens: int,
    chunk: int,
) -> tuple[Any, Any]:
    """Runs ``body(carry, start, size) -> (carry, ys)`` over token chunks.

    Full chunks run in a ``lax.scan`` over start offsets (inputs are sliced
    inside the loop, so no reshaped copy of ``hidden`` is made); a remainder
    of ``num_tokens % chunk`` tokens runs once after the loop with a static
    slice.  The per-chunk outputs ``ys`` (leading axis = chunk rows) are
    concatenated back to ``[num_tokens, ...]``.
    """
    n_full, rem = divmod(num_tokens, chunk)
    parts = []
    carry = init
    if n_full == 1:
        carry, ys = body(carry, 0, chunk)
        parts.append(ys)
    elif n_full > 1:
        carry, ys = lax.scan(
            lambda c, i: body(c, i * chunk, chunk), carry, jnp.arange(n_full)
        )
        parts.append(
            jax.tree.map(lambda y: y.reshape((n_full * chunk,) + y.shape[2:]), ys)
        )
    if rem:
        carry, ys = body(carry, n_full * chunk, rem)
        parts.append(ys)
    if len(parts) == 1:
        return carry, parts[0]
    return carry, jax.tree.map(lambda *p: jnp.concatenate(p, axis=0), *parts)


def _rows(x: jax.Array, start, size: int) -> jax.Array:
    return lax.dynamic_slice_in_dim(x, start, size, axis=0)


LAYOUTS = ("hv", "vh")


def vocab_axis(layout: str) -> int:
    """The weight's vocabulary axis: 1 for ``[H, V]`` ("hv"), 0 for ``[V, H]`` ("vh")."""
    return 1 if layout == "hv" else 0


def _raw_logits(h: jax.Array, weight: jax.Array, layout: str) -> jax.Array:
    """``h [C, H] @ W`` (``W`` = weight, or weight^T for "vh") with fp32 accumulation and fp32 result."""
    return lax.dot_general(
        h, weight, (((1,), (1 - vocab_axis(layout),)), ((), ())), preferred_element_type=_F32
    )


def _safe_targets(targets: jax.Array, vocab: int) -> jax.Array:
    # Ignored tokens may carry any id (e.g. -100); clip so gathers stay finite.
    return jnp.clip(targets, 0, vocab - 1)


def _capped_logits(h, weight, softcap: float | None, layout: str):
    """``(z, tanh(x / c))`` for one chunk, ``x = h @ W``; the tanh is None without soft-cap."""
    x = _raw_logits(h, weight, layout)
    if softcap is None:
        return x, None
    tz = jnp.tanh(x / softcap)
    return softcap * tz, tz


def _hidden_grad(dx, weight, layout: str):
    """``dx [C, V] @ W^T`` with fp32 accumulation."""
    return lax.dot_general(dx, weight, (((1,), (vocab_axis(layout),)), ((), ())), preferred_element_type=_F32)


def _weight_grad(h, dx, layout: str):
    """``h^T dx`` [H, V] ("hv") or ``dx^T h`` [V, H] ("vh") for one chunk, fp32."""
    lhs, rhs = (h, dx) if layout == "hv" else (dx, h)
    return lax.dot_general(lhs, rhs, (((0,), (0,)), ((), ())), preferred_element_type=_F32)


def _dlogits(z, tz, lse, t, coef, dtype):
    """``coef * (softmax(z) - onehot(t)) * dz/dx`` for one chunk, cast to the matmul dtype."""
    p = jnp.exp(z - lse[:, None])
    onehot = lax.broadcasted_iota(jnp.int32, z.shape, 1) == t[:, None]
    dx = coef[:, None] * (p - onehot.astype(_F32))
    if tz is not None:  # soft-cap: dz/dx = 1 - tanh(x / c)^2
        dx = dx * (1.0 - tz * tz)
    # The backward matmuls run in the input dtype (bf16 on GPU) with fp32 accumulation, like the
    # forward logits matmul.
    return dx.astype(dtype)


def _forward(hidden, weight, targets, chunk: int, softcap: float | None, layout: str, weights=None):
    """Per-token ``(lse [N], CE [N])`` in fp32, chunk by chunk; with ``weights`` also the unit hidden
    gradient ``U = dx(g=1) @ W^T`` [N, H] (the frozen-head eager gradient, see the module docstring)."""
    vocab = weight.shape[vocab_axis(layout)]
    dtype = jnp.promote_types(hidden.dtype, weight.dtype)

    def body(carry, start, size):
        z, tz = _capped_logits(_rows(hidden, start, size), weight, softcap, layout)
        lse = jax.nn.logsumexp(z, axis=-1)
        t = _safe_targets(_rows(targets, start, size), vocab)
        z_t = jnp.take_along_axis(z, t[:, None], axis=-1)[:, 0]
        if weights is None:
            return carry, (lse, lse - z_t)
        coef = _rows(weights, start, size).astype(_F32)
        unit = _hidden_grad(_dlogits(z, tz, lse, t, coef, dtype), weight, layout)
        return carry, (lse, lse - z_t, unit.astype(hidden.dtype))

    _, out = _scan_chunks(body, None, hidden.shape[0], chunk)
    return out


def _weighted_sum(weights: jax.Array, ce: jax.Array) -> jax.Array:
    return jnp.sum(weights.astype(_F32) * ce)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _linear_cross_entropy(hidden, weight, targets, weights, chunk, softcap, layout):
    _, ce = _forward(hidden, weight, targets, chunk, softcap, layout)
    return _weighted_sum(weights, ce)


def _fwd(hidden, weight, targets, weights, chunk, softcap, layout):
    perturbed = _Perturbed(
        hidden=hidden.perturbed, weight=weight.perturbed, weights=weights.perturbed
    )
    hidden, weight, targets, weights = (
        hidden.value, weight.value, targets.value, weights.value
    )
    if perturbed.hidden and not perturbed.weight:
        lse, ce, unit = _forward(hidden, weight, targets, chunk, softcap, layout, weights)
        loss = _weighted_sum(weights, ce)
        return loss, (unit, None, None, weights, None, ce if perturbed.weights else None, perturbed)
    lse, ce = _forward(hidden, weight, targets, chunk, softcap, layout)
    loss = _weighted_sum(weights, ce)
    # CE is only needed for d/dweights; keep [N] fp32 only then.
    residuals = (
        hidden, weight, targets, weights, lse, ce if perturbed.weights else None,
        perturbed,
    )
    return loss, residuals


def _bwd(chunk, softcap, layout, residuals, g):
    hidden, weight, targets, weights, lse, ce, perturbed = residuals
    if isinstance(g, SymbolicZero):
        return (None, None, None, None)
    if perturbed.hidden and not perturbed.weight:  # frozen head: dhidden = g * U, U from the forward
        unit = hidden
        dhidden = (g.astype(_F32) * unit.astype(_F32)).astype(unit.dtype)
        dweights = (g.astype(_F32) * ce).astype(weights.dtype) if perturbed.weights else None
        return (dhidden, None, None, dweights)
    need_dh, need_dw = perturbed.hidden, perturbed.weight
    num_tokens, vocab = hidden.shape[0], weight.shape[vocab_axis(layout)]
    compute_dtype = jnp.promote_types(hidden.dtype, weight.dtype)
    g = g.astype(_F32)

    dhidden = dweight = None
    if need_dh or need_dw:

        def body(dw_acc, start, size):
            h = _rows(hidden, start, size)
            z, tz = _capped_logits(h, weight, softcap, layout)
            t = _safe_targets(_rows(targets, start, size), vocab)
            coef = g * _rows(weights, start, size).astype(_F32)
            dx = _dlogits(z, tz, _rows(lse, start, size), t, coef, compute_dtype)
            dh = _hidden_grad(dx, weight, layout).astype(hidden.dtype) if need_dh else None
            if need_dw:
                dw_acc = dw_acc + _weight_grad(h, dx, layout)
            return dw_acc, dh

        init = jnp.zeros(weight.shape, _F32) if need_dw else None
        dw_acc, dhidden = _scan_chunks(body, init, num_tokens, chunk)
        if need_dw:
            dweight = dw_acc.astype(weight.dtype)

    dweights = (g * ce).astype(weights.dtype) if perturbed.weights else None
    return (dhidden, dweight, None, dweights)


_linear_cross_entropy.defvjp(_fwd, _bwd, symbolic_zeros=True)


def linear_cross_entropy_xla(
    hidden: jax.Array,
    weight: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    *,
    chunk_size: int,
    logit_softcap: float | None,
    weight_layout: str = "hv",
) -> jax.Array:
    """Chunked forward/backward; inputs are assumed validated by ``api.py``."""
    return _linear_cross_entropy(
        hidden, weight, targets, weights, chunk_size, logit_softcap, weight_layout
    )
