"""Adam with 8-bit moments (`optim: adamw_8bit`), the blockwise scheme of bitsandbytes' `AdamW8bit`.

Why: a full fine-tune keeps AdamW's two fp32 moments, 8 bytes a parameter, the largest part of its state (an 8B
model: 64 GB). Stored as one byte each, with one fp32 scale per block of 256 values, they take 2.03 bytes a
parameter, and each step still computes in fp32: the moments are decoded, updated with the gradient, used for
the update, and encoded again.

The code of a moment is the index of the nearest value in a 256-entry "dynamic" map (Dettmers, 8-Bit
Approximations for Parallelism in Deep Learning): a sign, a run of zeros that sets a power of ten, and a
linear fraction, so that values from 1e-7 to 1 of their block's largest magnitude keep about two significant
digits. The first moment uses the signed map, the second (never negative) the unsigned one, which spends the
sign bit on precision.

Blocks run along a weight's last axis, 256 values each, so a block never crosses a row: the codes have the
weight's shape and are sharded as it is (FSDP splits them like the weights), and for a weight whose last axis
is a multiple of 256 the blocks are exactly bitsandbytes' blocks over the flattened tensor. A weight with fewer
than 4,096 values or a last axis that is not a multiple of 256 keeps fp32 moments, as bitsandbytes keeps small
tensors (`min_8bit_size`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

BLOCK = 256
MIN_SIZE = 4096


def dynamic_map(signed: bool) -> np.ndarray:
    """The 256 sorted code values in [-1, 1] (signed) or [0, 1] (unsigned).

    Seven decades 10^-6 .. 10^0; in decade i the interval [0.1, 1] is cut into 2^i (signed) or 2^(i+1)
    (unsigned) equal parts and each part's midpoint, times 10^(i-6), is a code (negated too when signed);
    0 and 1 are codes, and the signed map's spare entries are zeros."""
    values: list[float] = []
    for i in range(7):
        edges = np.linspace(0.1, 1.0, 2 ** (i + (0 if signed else 1)) + 1, dtype=np.float32)
        mids = ((edges[:-1] + edges[1:]) / np.float32(2)).astype(np.float64) * 10.0 ** (i - 6)
        values += mids.tolist() + ((-mids).tolist() if signed else [])
    values += [0.0, 1.0]
    values += [0.0] * (256 - len(values))
    return np.sort(np.asarray(values, np.float32))


SIGNED = dynamic_map(True)
UNSIGNED = dynamic_map(False)


def eligible(shape: tuple[int, ...]) -> bool:
    """Whether a weight of `shape` keeps 8-bit moments (else fp32)."""
    return len(shape) >= 1 and int(np.prod(shape)) >= MIN_SIZE and shape[-1] % BLOCK == 0


def quantize(x: jax.Array, code: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """(uint8 codes of `x`'s shape, fp32 absmax per block [..., last // 256]): each value divided by its block's
    largest magnitude and rounded to the nearest code value."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK).astype(jnp.float32)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    scaled = blocks / jnp.where(absmax == 0, 1.0, absmax)[..., None]
    table = jnp.asarray(code)
    upper = jnp.clip(jnp.searchsorted(table, scaled), 1, len(code) - 1)
    nearer_lower = scaled - table[upper - 1] <= table[upper] - scaled
    idx = jnp.where(nearer_lower, upper - 1, upper).astype(jnp.uint8)
    return idx.reshape(x.shape), absmax


def dequantize(codes: jax.Array, absmax: jax.Array, code: np.ndarray) -> jax.Array:
    """The fp32 values `quantize` encoded (each code value times its block's absmax)."""
    values = jnp.asarray(code)[codes.reshape(*codes.shape[:-1], codes.shape[-1] // BLOCK, BLOCK)]
    return (values * absmax[..., None]).reshape(codes.shape)


class ScaleByAdam8bitState(NamedTuple):
    """`mu`, `nu`: trees shaped like the weights (uint8 codes, or fp32 moments for weights that are not
    `eligible`), so that a mesh places them as it places the weights; `mu_absmax`, `nu_absmax`: the block scales,
    one entry per weight in tree order (None for fp32 moments), small and replicated."""

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    mu_absmax: tuple
    nu_absmax: tuple


def scale_by_adam_8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> optax.GradientTransformation:
    """Adam's bias-corrected direction m_hat / (sqrt(v_hat) + eps), as `optax.scale_by_adam`, with the moments
    of every `eligible` weight stored in 8 bits between steps (the update uses the fp32 moments of this step,
    before they are encoded, as bitsandbytes does)."""

    def encode(x, code, eight_bit):
        return quantize(x, code) if eight_bit else (x, None)

    def decode(value, absmax, code):
        return value if absmax is None else dequantize(value, absmax, code)

    def init(params):
        leaves, treedef = jax.tree.flatten(params)
        if not leaves:
            return ScaleByAdam8bitState(jnp.zeros([], jnp.int32), params, params, (), ())
        mu, mu_absmax = zip(*[encode(jnp.zeros(p.shape, jnp.float32), SIGNED, eligible(p.shape)) for p in leaves])
        nu, nu_absmax = zip(*[encode(jnp.zeros(p.shape, jnp.float32), UNSIGNED, eligible(p.shape)) for p in leaves])
        return ScaleByAdam8bitState(jnp.zeros([], jnp.int32), jax.tree.unflatten(treedef, mu),
                                    jax.tree.unflatten(treedef, nu), tuple(mu_absmax), tuple(nu_absmax))

    def update(updates, state, params=None):
        del params
        count = optax.safe_int32_increment(state.count)
        c1 = 1 - jnp.asarray(b1, jnp.float32) ** count
        c2 = 1 - jnp.asarray(b2, jnp.float32) ** count
        grads, treedef = jax.tree.flatten(updates)
        if not grads:
            return updates, state._replace(count=count)
        out = []
        for g, mu, nu, mu_absmax, nu_absmax in zip(grads, treedef.flatten_up_to(state.mu),
                                                   treedef.flatten_up_to(state.nu), state.mu_absmax,
                                                   state.nu_absmax):
            g = g.astype(jnp.float32)
            m = b1 * decode(mu, mu_absmax, SIGNED) + (1 - b1) * g
            v = b2 * decode(nu, nu_absmax, UNSIGNED) + (1 - b2) * jnp.square(g)
            eight_bit = mu_absmax is not None
            out.append(((m / c1) / (jnp.sqrt(v / c2) + eps), encode(m, SIGNED, eight_bit),
                        encode(v, UNSIGNED, eight_bit)))
        direction, mu, nu = zip(*out)
        (mu, mu_absmax), (nu, nu_absmax) = zip(*mu), zip(*nu)
        return jax.tree.unflatten(treedef, direction), ScaleByAdam8bitState(
            count, jax.tree.unflatten(treedef, mu), jax.tree.unflatten(treedef, nu), tuple(mu_absmax),
            tuple(nu_absmax))

    return optax.GradientTransformation(init, update)
