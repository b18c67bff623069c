"""Where every patch of a flat multi-image patch sequence sits, computed on the device from `grid_thw`.

The processor (transformers' Qwen2-VL image processor) emits the patches of all images of a batch as one
[N, patch_dim] array, image after image, each image frame by frame and each frame in *merge-block-major*
order: blocks of `m x m` neighbouring patches (m = spatial_merge_size) row-major over the
(h/m, w/m) block grid, the m*m patches of a block row-major inside it. `grid_thw` [I, 3] holds (t, h, w) in
patches per image. From it and the static N this module derives, with array ops only (jit-able, no host
loop, the grid values may be traced):

- `hw` [N, 2]: each patch's (row, column) in its frame, the 2-D RoPE positions;
- `frame_segments` [N]: one id per frame of each image (ids >= 1), the full-attention segments: a patch never
  attends outside its own frame (transformers' `cu_seqlens`);
- `window_segments` [N] (2.5-VL): one id per window of `window_units` x `window_units` merged tokens of a frame
  (the windows tile the block grid from its top-left corner; edge windows are smaller);
- `window_order` [N / m^2]: the merge blocks sorted by window (stable, so row-major inside a window), i.e.
  transformers' `window_index`. Running the blocks in that order keeps every window contiguous, as the packed
  attention kernels expect of segments.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxft.vision_config import VisionConfig


@dataclasses.dataclass(frozen=True)
class PatchLayout:
    hw: jax.Array
    frame_segments: jax.Array
    window_segments: jax.Array
    window_order: jax.Array | None


jax.tree_util.register_dataclass(PatchLayout, data_fields=["hw", "frame_segments", "window_segments",
                                                            "window_order"], meta_fields=[])


def patch_layout(grid_thw: jax.Array, num_patches: int, cfg: VisionConfig) -> PatchLayout:
    """The layout of `num_patches` patches of the images `grid_thw` [I, 3] (see the module docstring)."""
    g = jnp.asarray(grid_thw, jnp.int32).reshape(-1, 3)
    m = cfg.spatial_merge_size
    sizes = g[:, 0] * g[:, 1] * g[:, 2]
    ends = jnp.cumsum(sizes)
    p = jnp.arange(num_patches, dtype=jnp.int32)
    img = jnp.minimum(jnp.searchsorted(ends, p, side="right"), g.shape[0] - 1)
    local = p - (ends - sizes)[img]
    h_img, w_img = g[img, 1], g[img, 2]
    per_frame = h_img * w_img
    frame, r = local // per_frame, local % per_frame
    unit, within = r // (m * m), r % (m * m)
    blocks_w = w_img // m
    bh, bw = unit // blocks_w, unit % blocks_w
    hw = jnp.stack([bh * m + within // m, bw * m + within % m], axis=-1)
    frame_id = (jnp.cumsum(g[:, 0]) - g[:, 0])[img] + frame
    frame_segments = frame_id + 1
    if not cfg.window_units:
        return PatchLayout(hw, frame_segments, frame_segments, None)
    ws = cfg.window_units
    # A window's id: the flat index (+1) of its top-left patch, unique over the whole sequence, and increasing
    # with (image, frame, window row, window column): sorting by it orders windows as transformers does.
    frame_start = p - r
    corner = ((bh // ws) * ws * blocks_w + (bw // ws) * ws) * (m * m)
    window_segments = frame_start + corner + 1
    window_order = jnp.argsort(window_segments[:: m * m], stable=True).astype(jnp.int32)
    return PatchLayout(hw, frame_segments, window_segments, window_order)


def expand_order(order: jax.Array, unit: int) -> jax.Array:
    """A permutation of merge blocks [N / unit] as the permutation of their patches [N]."""
    return (order[:, None] * unit + jnp.arange(unit, dtype=order.dtype)[None, :]).reshape(-1)
