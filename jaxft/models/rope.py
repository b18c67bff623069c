"""Rotary position embeddings, computed the way transformers computes them.

inv_freq_i = theta^(-2i/dim) for i < dim/2, rescaled per `rope_type`:
- linear:  inv_freq / factor
- dynamic: theta' = theta * (factor * L / L_max - (factor - 1))^(dim / (dim - 2)), L = max(max position + 1, L_max)
- llama3:  wavelengths above L0/low_freq_factor are divided by `factor`, below L0/high_freq_factor kept, smooth
           interpolation in between
- yarn:    per-dimension blend of interpolated (inv/factor) and extrapolated (inv) frequencies with a linear
           ramp between the correction dims of beta_fast and beta_slow; cos and sin scaled by attention_factor.
The angle table `pos * inv_freq` is formed in fp32 and cos/sin are cast to the activation dtype, as in
transformers, so bf16 runs round exactly where the reference rounds.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxft.rope_config import RopeConfig


def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    return (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))).astype(np.float32)


def inv_freq_and_scale(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Static inverse frequencies [dim/2] (fp32) and the cos/sin multiplier. `dynamic` is handled in `rope_tables`."""
    inv = _base_inv_freq(rope.theta, dim)
    kind = rope.rope_type
    if kind in ("default", "dynamic"):
        return inv, 1.0
    if kind == "linear":
        return (inv / np.float32(rope.factor)).astype(np.float32), 1.0
    if kind == "llama3":
        l0 = rope.original_max_position_embeddings
        low_wavelen = l0 / rope.low_freq_factor
        high_wavelen = l0 / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        out = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (l0 / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * out / rope.factor + smooth * out
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, out).astype(np.float32), 1.0
    if kind == "yarn":
        return _yarn(rope, dim)
    raise ValueError(f"unsupported rope_type {kind!r}")


def _yarn(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    factor, l0, base = rope.factor, rope.original_max_position_embeddings, rope.theta

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations):
        return dim * math.log(l0 / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = (base ** (np.arange(0, dim, 2).astype(np.float32) / dim)).astype(np.float32)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv.astype(np.float32), float(attention_factor)


def rope_tables(positions: jnp.ndarray, rope: RopeConfig, dim: int, max_position_embeddings: int, dtype):
    """cos, sin [B, T, dim] for integer positions [B, T]; computed once per batch and shared by all layers."""
    inv, scale = inv_freq_and_scale(rope, dim, max_position_embeddings)
    inv = jnp.asarray(inv)
    if rope.rope_type == "dynamic":
        # Data-dependent: transformers recomputes theta from the longest position in the batch.
        seq_len = jnp.maximum(jnp.max(positions) + 1, max_position_embeddings).astype(jnp.float32)
        base = rope.theta * ((rope.factor * seq_len / max_position_embeddings) - (rope.factor - 1)) ** (dim / (dim - 2))
        inv = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * scale).astype(dtype), (jnp.sin(emb) * scale).astype(dtype)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """x [B, T, N, D] rotated with non-interleaved halves: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def mrope_tables(positions: jnp.ndarray, rope: RopeConfig, dim: int, max_position_embeddings: int, dtype,
                 section: tuple[int, ...]):
    """cos, sin [B, T, dim] of multimodal RoPE (Qwen2-VL) for 3-D positions [3, B, T] (t, h, w).

    Frequency j < dim/2 turns with the position row (s mod 3), s the index of the `section` chunk holding j
    (sum(section) == dim / 2): the first chunk with t, the next with h, then w. Both halves of the head use
    the same table, as in `rope_tables`. 1-D positions broadcast to all three rows (plain RoPE)."""
    inv, scale = inv_freq_and_scale(rope, dim, max_position_embeddings)
    if positions.ndim == 2:
        positions = jnp.broadcast_to(positions[None], (3, *positions.shape))
    rows = np.repeat(np.arange(len(section)) % 3, section)  # [dim / 2]: which position row drives each freq
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)  # [3, B, T, dim / 2]
    freqs = jnp.where(rows == 0, freqs[0], jnp.where(rows == 1, freqs[1], freqs[2]))  # a selection, exact
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (jnp.cos(emb) * scale).astype(dtype), (jnp.sin(emb) * scale).astype(dtype)
