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
