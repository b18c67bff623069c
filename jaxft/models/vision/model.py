"""A vision-language model: the decoder fed `inputs_embeds` in which image pad tokens carry the vision tower's
merged patch embeddings, with M-RoPE positions (Qwen2-VL, Qwen2.5-VL).

    input_ids [B, T] (each image: a run of image_token_id, one per merged token), pixel_values [N, patch_dim],
    image_grid_thw [I, 3] (the processor's outputs; images in row-major order of their runs)
      -> embeds = token embeddings; embeds[image tokens] = tower(pixel_values, image_grid_thw)  (in order)
      -> positions [3, B, T] = mrope_positions(input_ids, image_grid_thw)  (per segment when packed)
      -> Decoder.hidden_states(inputs_embeds=embeds, positions=positions)
Everything is array ops on the device, once per batch: the number of image tokens is N / m^2 (static), the
grids may be traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxft.config import ModelConfig
from jaxft.execution import ExecutionConfig
from jaxft.models.decoder import DEFAULT_EXECUTION, Decoder
from jaxft.models.vision.mrope import mrope_positions
from jaxft.models.vision.tower import VisionTower


class VisionLanguageModel(Decoder):
    """`model(input_ids, positions=None, segment_ids=None, *, pixel_values=None, image_grid_thw=None)`:
    logits [B, T, V]. Without images it is the text decoder (positions (p, p, p))."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        super().__init__(cfg, dtype=dtype, rngs=rngs)
        self.vision = VisionTower(cfg.vision, dtype=dtype, rngs=rngs)

    def multimodal_inputs(self, input_ids, pixel_values=None, image_grid_thw=None, segment_ids=None,
                          execution: ExecutionConfig = DEFAULT_EXECUTION) -> tuple[jax.Array, jax.Array]:
        """(inputs_embeds [B, T, H], M-RoPE positions [3, B, T]) of a batch."""
        v = self.config.vision
        ids = jnp.asarray(input_ids, jnp.int32)
        x = self.embed_tokens(ids)
        positions = mrope_positions(ids, image_grid_thw, v, segment_ids)
        if pixel_values is None:
            return x, positions
        with jax.named_scope("image_embeds"):
            feats = self.vision(pixel_values, image_grid_thw, implementation=_vision_attention(execution))
            mask = (ids == v.image_token_id).reshape(-1)
            _check_counts(input_ids, feats.shape[0], v.image_token_id)
            where = jnp.nonzero(mask, size=feats.shape[0], fill_value=mask.shape[0])[0]
            flat = x.reshape(-1, x.shape[-1]).at[where].set(feats.astype(x.dtype), mode="drop")
        return flat.reshape(x.shape), positions

    def hidden_states(self, input_ids=None, positions=None, segment_ids=None, *, dropout_rng=None,
                      execution: ExecutionConfig = DEFAULT_EXECUTION, inputs_embeds=None, pixel_values=None,
                      image_grid_thw=None) -> jax.Array:
        if input_ids is not None and inputs_embeds is None:
            inputs_embeds, mrope = self.multimodal_inputs(input_ids, pixel_values, image_grid_thw, segment_ids,
                                                          execution)
            positions = mrope if positions is None else positions
            input_ids = None
        elif pixel_values is not None:
            raise ValueError("VisionLanguageModel: pixel_values need input_ids (their image tokens say where the "
                             "image embeddings go)")
        return super().hidden_states(input_ids, positions, segment_ids, dropout_rng=dropout_rng, execution=execution,
                                     inputs_embeds=inputs_embeds)

    def __call__(self, input_ids=None, positions=None, segment_ids=None, *, dropout_rng=None,
                 execution: ExecutionConfig = DEFAULT_EXECUTION, inputs_embeds=None, pixel_values=None,
                 image_grid_thw=None) -> jax.Array:
        return self.logits(self.hidden_states(input_ids, positions, segment_ids, dropout_rng=dropout_rng,
                                              execution=execution, inputs_embeds=inputs_embeds,
                                              pixel_values=pixel_values, image_grid_thw=image_grid_thw))


def flat_images(row_pixels: jax.Array, row_grids: jax.Array, cfg) -> tuple[jax.Array, jax.Array]:
    """A packed batch's per-row images (`jaxft.data.packing`: pixel_values [B, P * patch_dim], image_grid_thw
    [B, G * 3], each row's images first, zeros after) -> the processor's flat form: pixel_values [B * P,
    patch_dim] with every real patch first (row after row, image after image) and the padding patches after
    them, image_grid_thw [B * G + 1, 3] with the real grids first, the unused (all-zero) ones next, and last one
    padding "image" (1, m, pad / m) covering the B * P - N padding patches (pad is a multiple of m^2, so it is a
    valid merge grid). The padding image is a segment of its own in the tower, so it changes no real patch; its
    merged tokens match no image token and are dropped. Array ops only (jit-able; the grids may be traced)."""
    b = row_pixels.shape[0]
    pixels = row_pixels.reshape(-1, cfg.patch_dim)
    per_row = pixels.shape[0] // b
    grids = jnp.asarray(row_grids, jnp.int32).reshape(b, -1, 3)
    real = jnp.sum(jnp.prod(grids, axis=-1), axis=1)  # patches per row
    is_pad = (jnp.arange(per_row)[None, :] >= real[:, None]).reshape(-1)
    pixels = pixels[jnp.argsort(is_pad, stable=True)]
    grids = grids.reshape(-1, 3)
    grids = grids[jnp.argsort(jnp.prod(grids, axis=-1) == 0, stable=True)]
    m = cfg.spatial_merge_size
    pad = pixels.shape[0] - jnp.sum(real)
    dummy = jnp.stack([jnp.ones((), jnp.int32), jnp.full((), m, jnp.int32), (pad // m).astype(jnp.int32)])
    return pixels, jnp.concatenate([grids, dummy[None]], axis=0)


def _vision_attention(execution: ExecutionConfig) -> str:
    """The tower's attention implementation: the reference when the step asks for it, else "auto", which picks
    per shape among the kernels that support it. Not the decoder's choice as such: the released towers have
    head_dim 80 (1280 / 16), which no Pallas tile size fits, so a forced "pallas" would fail there."""
    return "reference" if execution.attention == "reference" else "auto"


def _check_counts(input_ids, num_features: int, image_token_id: int) -> None:
    """One clear error when the ids are concrete (not traced) and their image tokens do not match the image
    features (under jit the scatter would silently drop or leave tokens)."""
    if isinstance(input_ids, jax.core.Tracer):
        return
    count = int(np.sum(np.asarray(input_ids) == image_token_id))
    if count != num_features:
        raise ValueError(f"input_ids hold {count} image tokens (id {image_token_id}) but pixel_values give "
                         f"{num_features} merged image embeddings; build input_ids with the processor that made "
                         "pixel_values (one image token per merged patch)")
