"""Building a model from its config: the class (`Decoder`, or the vision-language one), randomly initialised or
abstract. Above both classes, so that neither imports the other's module."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxft.config import ModelConfig
from jaxft.models.decoder import Decoder
from jaxft.models.vision.model import VisionLanguageModel


def model_class(cfg: ModelConfig) -> type[Decoder]:
    """`Decoder`, or its vision-language subclass when the config has a vision tower."""
    if cfg.vision is None:
        return Decoder
    return VisionLanguageModel


def init_model(cfg: ModelConfig, *, dtype=jnp.bfloat16, seed: int = 0, **kw) -> Decoder:
    """A randomly initialised model (normal(0, 0.02) linears and embeddings, unit norms)."""
    return model_class(cfg)(cfg, dtype=dtype, rngs=nnx.Rngs(seed), **kw)


def abstract_model(cfg: ModelConfig, *, dtype=jnp.bfloat16, **kw) -> Decoder:
    """The model with `jax.ShapeDtypeStruct` leaves: no memory is allocated (for real-size shape checks)."""
    return nnx.eval_shape(lambda: model_class(cfg)(cfg, dtype=dtype, rngs=nnx.Rngs(0), **kw))
