"""M-RoPE positions: the 3-D (t, h, w) position of every token of a batch with images, on the device.

transformers' `get_rope_index` walks each row on the host; this computes the same positions with array ops
(jit-able; the image grids may be traced), once per batch. Per document (a row, or a `segment_ids` segment of
a packed row) a counter c starts at 0:
- a text token gets (c, c, c), then c += 1;
- an image (a maximal run of `image_token_id` tokens; the k-th run of the batch in row-major order is image k
  of `image_grid_thw`, with a merged grid of (t, h / m, w / m) tokens) gets, for its j-th token,
  (c + j // (h'w'), c + (j // w') % h', c + j % w'), then c += max(h', w')  (transformers 5's advance).
Text-only documents get (p, p, p): plain RoPE. Videos (`video_token_id`) are not modelled.

Vectorised: every token carries an increment (1 for text, 0 inside an image, max(h', w') on an image's last
token); c at a token is the exclusive cumulative sum of increments since its document's start.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxft.vision_config import VisionConfig


def _starts(mask: jax.Array) -> jax.Array:
    return jnp.concatenate([jnp.ones_like(mask[:, :1]), mask[:, 1:] != mask[:, :-1]], axis=1)


def mrope_positions(input_ids: jax.Array, image_grid_thw: jax.Array | None, cfg: VisionConfig,
                    segment_ids: jax.Array | None = None) -> jax.Array:
    """int32 positions [3, B, T] of `input_ids` [B, T] whose image tokens belong to `image_grid_thw` [I, 3]."""
    ids = jnp.asarray(input_ids, jnp.int32)
    b, t = ids.shape
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    doc_start = _starts(jnp.zeros_like(ids) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32))
    doc_first = jax.lax.cummax(jnp.where(doc_start, idx, 0), axis=1)
    if image_grid_thw is None:
        pos = idx - doc_first
        return jnp.broadcast_to(pos[None], (3, b, t))
    img = ids == cfg.image_token_id
    prev = jnp.concatenate([jnp.zeros_like(img[:, :1]), img[:, :-1]], axis=1)
    run_start = img & (~prev | doc_start)
    nxt_start = jnp.concatenate([run_start[:, 1:] | doc_start[:, 1:], jnp.ones_like(img[:, :1])], axis=1)
    nxt_img = jnp.concatenate([img[:, 1:], jnp.zeros_like(img[:, :1])], axis=1)
    run_last = img & (~nxt_img | nxt_start)
    grids = jnp.asarray(image_grid_thw, jnp.int32).reshape(-1, 3)
    k = jnp.cumsum(run_start.reshape(-1)).reshape(b, t) - 1  # image index, row-major over the batch
    g = grids[jnp.clip(k, 0, grids.shape[0] - 1)]
    m = cfg.spatial_merge_size
    gh, gw = g[..., 1] // m, g[..., 2] // m
    inc = jnp.where(img, jnp.where(run_last, jnp.maximum(gh, gw), 0), 1)
    before = jnp.cumsum(inc, axis=1) - inc
    base = before - jnp.take_along_axis(before, doc_first, axis=1)
    j = idx - jax.lax.cummax(jnp.where(run_start, idx, 0), axis=1)
    hw = jnp.maximum(gh * gw, 1)
    offsets = [j // hw, (j // jnp.maximum(gw, 1)) % jnp.maximum(gh, 1), j % jnp.maximum(gw, 1)]
    return jnp.stack([base + jnp.where(img, o, 0) for o in offsets]).astype(jnp.int32)
