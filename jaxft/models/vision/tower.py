"""The Qwen2-VL / Qwen2.5-VL vision tower and patch merger in Flax NNX.

    pixel_values [N, C*T*P*P] (the processor's patches)                      grid_thw [I, 3]
      -> patch embedding: x = pixels @ W^T, W = the Conv3d kernel [E, C, T, P, P] flattened (kernel = stride =
         one patch, so the convolution is one matmul per patch)
      -> 2.5-VL: patches reordered merge block by merge block into window order (`layout.window_order`)
      -> `depth` blocks, scanned:  x += proj(attn(rope(qkv(norm1(x)))));  x += mlp(norm2(x))
           attention: bidirectional, per head, scale head_dim^-0.5, inside one segment only: the patch's frame
           (full-attention blocks; every 2-VL block) or its window (the other 2.5-VL blocks). It is the
           decoder's attention op (`kernels_pallas.attention`) with causal=False and those segment ids.
           RoPE: 2-D, the first half of each head's rotated pairs turn with the patch row, the second with the
           column (frequencies theta^(-4j/head_dim)), applied in fp32 as transformers does.
           2-VL: LayerNorm, fc2(quick_gelu(fc1 x));  2.5-VL: RMSNorm, down(silu(gate x) * up x), all biased.
      -> merger: norm (LayerNorm / RMSNorm, eps 1e-6), every m*m consecutive patches concatenated
         [N / m^2, m^2 E], fc2(gelu(fc1 .)) -> [N / m^2, out_hidden_size]
      -> 2.5-VL: merged tokens put back in image order.
The merged tokens of image i are rows [sum_{j<i} n_j, ... + n_i) with n_j = t_j h_j w_j / m^2: the embeddings
that replace the image's pad tokens in the text.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxft.models.layers import Linear, logical, stack_axes
from jaxft.models.parts import RMSNorm
from jaxft.models.rope import apply_rope
from jaxft.models.vision.layout import PatchLayout, expand_order, patch_layout
from jaxft.vision_config import VisionConfig
from kernels_pallas import attention as attention_ops

_EPS = 1e-6  # transformers hard-codes the vision norms' eps

ACTIVATIONS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "silu": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


class LayerNorm(nnx.Module):
    """(x - mean) / sqrt(var + eps) * w + b over the last axis, statistics and affine in fp32 (torch's LayerNorm)."""

    def __init__(self, dim: int, *, stack: tuple[int, ...], dtype):
        axes = logical(*stack_axes(stack), "norm")
        self.scale = nnx.Param(jnp.ones((*stack, dim), dtype), **axes)
        self.bias = nnx.Param(jnp.zeros((*stack, dim), dtype), **axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + _EPS)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def _norm(cfg: VisionConfig, dim: int, stack, dtype):
    if cfg.kind == "qwen2_vl":
        return LayerNorm(dim, stack=stack, dtype=dtype)
    return RMSNorm(dim, eps=_EPS, stack=stack, dtype=dtype)


def vision_rope(hw: jax.Array, cfg: VisionConfig) -> tuple[jax.Array, jax.Array]:
    """fp32 cos, sin [N, head_dim] of the 2-D RoPE for patch positions hw [N, 2] (row, column)."""
    quarter = cfg.head_dim // 2
    inv = (1.0 / (cfg.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter))).astype(np.float32)
    freqs = hw.astype(jnp.float32)[..., None] * jnp.asarray(inv)  # [N, 2, head_dim / 4]
    freqs = freqs.reshape(hw.shape[0], -1)  # rows' frequencies, then columns'
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


class VisionBlock(nnx.Module):
    """One (stacked) vision block; see the module docstring for its math."""

    def __init__(self, cfg: VisionConfig, *, stack, dtype, rngs):
        e = cfg.embed_dim
        lin = dict(bias=True, stack=stack, dtype=dtype, rngs=rngs)
        self.norm1, self.norm2 = _norm(cfg, e, stack, dtype), _norm(cfg, e, stack, dtype)
        self.qkv = Linear(e, 3 * e, **lin)
        self.proj = Linear(e, e, **lin)
        if cfg.kind == "qwen2_vl":
            self.fc1, self.fc2 = Linear(e, cfg.mlp_dim, **lin), Linear(cfg.mlp_dim, e, **lin)
            self.gate_proj = self.up_proj = self.down_proj = None
        else:
            self.gate_proj, self.up_proj = Linear(e, cfg.mlp_dim, **lin), Linear(e, cfg.mlp_dim, **lin)
            self.down_proj = Linear(cfg.mlp_dim, e, **lin)
            self.fc1 = self.fc2 = None
        self.num_heads, self.head_dim, self.act = cfg.num_heads, cfg.head_dim, cfg.hidden_act

    def attention(self, x, cos, sin, segments, implementation) -> jax.Array:
        n = x.shape[0]
        q, k, v = jnp.split(self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim), 3, axis=1)
        q, k, v = (a.reshape(1, n, self.num_heads, self.head_dim) for a in (q, k, v))
        q, k = (apply_rope(a.astype(jnp.float32), cos[None], sin[None]).astype(x.dtype) for a in (q, k))
        o = attention_ops.dot_product_attention(q, k, v, segment_ids=segments[None], causal=False,
                                                implementation=implementation)
        return self.proj(o.reshape(n, -1))

    def mlp(self, x) -> jax.Array:
        act = ACTIVATIONS[self.act]
        if self.fc1 is not None:
            return self.fc2(act(self.fc1(x)))
        return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))

    def __call__(self, x, cos, sin, segments, implementation="reference") -> jax.Array:
        x = x + self.attention(self.norm1(x), cos, sin, segments, implementation)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """norm, m*m neighbouring patches concatenated, fc2(gelu(fc1 .)) to the text width."""

    def __init__(self, cfg: VisionConfig, *, dtype, rngs):
        wide = cfg.embed_dim * cfg.merge_unit
        self.ln_q = _norm(cfg, cfg.embed_dim, (), dtype)
        self.fc1 = Linear(wide, wide, bias=True, stack=(), dtype=dtype, rngs=rngs)
        self.fc2 = Linear(wide, cfg.out_hidden_size, bias=True, stack=(), dtype=dtype, rngs=rngs)
        self.wide = wide

    def __call__(self, x) -> jax.Array:
        x = self.ln_q(x).reshape(-1, self.wide)
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class VisionTower(nnx.Module):
    """`tower(pixel_values [N, patch_dim], grid_thw [I, 3]) -> merged image tokens [N / m^2, out_hidden_size]`."""

    def __init__(self, cfg: VisionConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.patch_embed = nnx.Module()
        shape = (cfg.embed_dim, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        init = (jnp.zeros(shape, dtype) if rngs is None else
                (jax.random.normal(rngs.params(), shape, jnp.float32) * 0.02).astype(dtype))
        self.patch_embed.kernel = nnx.Param(init, **logical(*(None,) * len(shape)))
        self.blocks = VisionBlock(cfg, stack=(cfg.depth,), dtype=dtype, rngs=rngs)
        self.merger = PatchMerger(cfg, dtype=dtype, rngs=rngs)

    def layout(self, grid_thw, num_patches: int) -> PatchLayout:
        return patch_layout(grid_thw, num_patches, self.config)

    def embed_patches(self, pixel_values) -> jax.Array:
        w = self.patch_embed.kernel[...]
        x = jnp.asarray(pixel_values).reshape(-1, self.config.patch_dim).astype(self.dtype)
        return jnp.einsum("np,ep->ne", x, w.reshape(w.shape[0], -1).astype(self.dtype))

    def __call__(self, pixel_values, grid_thw, *, implementation: str = "reference") -> jax.Array:
        cfg = self.config
        with jax.named_scope("vision_tower"):
            x = self.embed_patches(pixel_values)
            lay = self.layout(grid_thw, x.shape[0])
            cos, sin = vision_rope(lay.hw, cfg)
            frames, windows = lay.frame_segments, lay.window_segments
            if lay.window_order is not None:
                order = expand_order(lay.window_order, cfg.merge_unit)
                x, cos, sin, frames, windows = (a[order] for a in (x, cos, sin, frames, windows))
            full = jnp.asarray([cfg.full_attention(i) for i in range(cfg.depth)])
            graphdef, state = nnx.split(self.blocks)

            def body(x, xs):
                block_state, is_full = xs
                block = nnx.merge(graphdef, block_state)
                return block(x, cos, sin, jnp.where(is_full, frames, windows), implementation), None

            x, _ = jax.lax.scan(body, x, (state, full))
            merged = self.merger(x)
            if lay.window_order is not None:
                merged = merged[jnp.argsort(lay.window_order)]
            return merged
