"""A vision-language model: the decoder fed `inputs_embeds` in which image pad tokens carry the vision tower's
merged patch embeddings, with M-RoPE positions (Qwen2-VL, Qwen2.5-VL).

    input_ids [B, T] (each image: a run of image_token_id, one per merged token), pixel_values [N, patch_dim],
    image_grid_thw [I, 3] (the processor's outputs; images in row-major order of their runs)
      -> embeds = token embeddings; embeds[image tokens] = tower(pixel_values, image_grid_thw)  (in order)
      -> positions [3, B, T] = mrope_positions(input_ids, image_grid_thw)  (per segment when packed)
      -> Decoder.hidden_states(inputs_embeds=embeds, positions=positions)
Everything is array ops on the device, once per batch: the number of image tokens is N / m^2 (static), the
grids may be traced.

A packed training batch carries its images per row (`pixel_rows` [B, P * patch_dim], `grid_rows` [B, G * 3]:
`jaxft.data.packing`). Under a mesh of several devices each device runs the tower on its own rows' images only
(`per_device_images`); as one program over the batch the tower's input is every image of the batch in one packed
sequence, which XLA does not split, so every device would run the whole batch's tower.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxft.config import ModelConfig
from jaxft.memory.execution import ExecutionConfig
from jaxft.mesh_axes import row_split
from jaxft.models.decoder import DEFAULT_EXECUTION, Decoder
from jaxft.models.vision.mrope import mrope_positions
from jaxft.models.vision.tower import VisionTower


class VisionLanguageModel(Decoder):
    """`model(input_ids, positions=None, segment_ids=None, *, pixel_values=None, image_grid_thw=None)`:
    logits [B, T, V]; a packed batch's per-row images go in as `pixel_rows` / `grid_rows` instead. Without images
    it is the text decoder (positions (p, p, p))."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        super().__init__(cfg, dtype=dtype, rngs=rngs)
        self.vision = VisionTower(cfg.vision, dtype=dtype, rngs=rngs)

    def multimodal_inputs(self, input_ids, pixel_values=None, image_grid_thw=None, segment_ids=None,
                          execution: ExecutionConfig = DEFAULT_EXECUTION, pixel_rows=None,
                          grid_rows=None) -> tuple[jax.Array, jax.Array]:
        """(inputs_embeds [B, T, H], M-RoPE positions [3, B, T]) of a batch whose images come flat
        (`pixel_values`, `image_grid_thw`: the processor's form) or per row (`pixel_rows`, `grid_rows`: a packed
        batch's, see `flat_images`)."""
        v = self.config.vision
        ids = jnp.asarray(input_ids, jnp.int32)
        x = self.embed_tokens(ids)
        if pixel_rows is not None:
            _, grids = flat_images(pixel_rows, grid_rows, v)  # the batch's grid list; the pixels are sorted per device
            with jax.named_scope("image_embeds"):
                x = per_device_images(self.vision, x, ids, pixel_rows, grid_rows, _vision_attention(execution))
            return x, mrope_positions(ids, grids, v, segment_ids)
        positions = mrope_positions(ids, image_grid_thw, v, segment_ids)
        if pixel_values is None:
            return x, positions
        _check_counts(input_ids, pixel_values.shape[0] // v.spatial_merge_size ** 2, v.image_token_id)
        with jax.named_scope("image_embeds"):
            x = put_images(self.vision, x, ids, pixel_values, image_grid_thw, _vision_attention(execution))
        return x, positions

    def hidden_states(self, input_ids=None, positions=None, segment_ids=None, *, dropout_rng=None,
                      execution: ExecutionConfig = DEFAULT_EXECUTION, inputs_embeds=None, pixel_values=None,
                      image_grid_thw=None, pixel_rows=None, grid_rows=None) -> jax.Array:
        if input_ids is not None and inputs_embeds is None:
            inputs_embeds, mrope = self.multimodal_inputs(input_ids, pixel_values, image_grid_thw, segment_ids,
                                                          execution, pixel_rows=pixel_rows, grid_rows=grid_rows)
            positions = mrope if positions is None else positions
            input_ids = None
        elif pixel_values is not None or pixel_rows is not None:
            raise ValueError("VisionLanguageModel: pixel_values need input_ids (their image tokens say where the "
                             "image embeddings go)")
        return super().hidden_states(input_ids, positions, segment_ids, dropout_rng=dropout_rng, execution=execution,
                                     inputs_embeds=inputs_embeds)

    def __call__(self, input_ids=None, positions=None, segment_ids=None, *, dropout_rng=None,
                 execution: ExecutionConfig = DEFAULT_EXECUTION, inputs_embeds=None, pixel_values=None,
                 image_grid_thw=None, pixel_rows=None, grid_rows=None) -> jax.Array:
        return self.logits(self.hidden_states(input_ids, positions, segment_ids, dropout_rng=dropout_rng,
                                              execution=execution, inputs_embeds=inputs_embeds,
                                              pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                                              pixel_rows=pixel_rows, grid_rows=grid_rows))


def put_images(tower: VisionTower, x, ids, pixel_values, image_grid_thw, implementation: str) -> jax.Array:
    """`x` [B, T, H] with the tower's merged embeddings of the flat images (`pixel_values` [N, patch_dim],
    `image_grid_thw` [I, 3]) at the image tokens of `ids` [B, T], in order."""
    feats = tower(pixel_values, image_grid_thw, implementation=implementation)
    mask = (ids == tower.config.image_token_id).reshape(-1)
    where = jnp.nonzero(mask, size=feats.shape[0], fill_value=mask.shape[0])[0]
    return x.reshape(-1, x.shape[-1]).at[where].set(feats.astype(x.dtype), mode="drop").reshape(x.shape)


def per_device_images(tower: VisionTower, x, ids, pixel_rows, grid_rows, implementation: str) -> jax.Array:
    """`put_images` of a packed batch's per-row images, each device on its own rows when traced under a mesh of
    several devices whose batch axes divide the rows (`jax.shard_map` over `jaxft.mesh_axes.row_split`, as
    `constrain_rows` splits the layer inputs); otherwise on the whole batch. A row's image tokens hold exactly
    its own images' embeddings, so the rows' images can be embedded apart.

    The tower's weights enter whole (P(): XLA gathers any that are split, as for a matmul); the gradients of its
    adapters (`finetune_vision_layers`) are summed over the devices by shard_map's transpose. A tensor axis holds
    copies of the rows: its devices embed the same images."""
    mesh = jax.get_abstract_mesh()
    axes = row_split(mesh, x.shape[0])

    def local(state, x, ids, pixel_rows, grid_rows):
        pixels, grids = flat_images(pixel_rows, grid_rows, tower.config)
        return put_images(nnx.merge(graphdef, state), x, ids, pixels, grids, implementation)

    graphdef, state = nnx.split(tower)
    if not axes:
        return local(state, x, ids, pixel_rows, grid_rows)
    rows = jax.P(axes)
    return jax.shard_map(local, mesh=mesh, in_specs=(jax.P(), rows, rows, rows, rows), out_specs=rows,
                         check_vma=False)(state, x, ids, pixel_rows, grid_rows)


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
