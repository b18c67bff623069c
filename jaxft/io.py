"""Hugging Face checkpoints in and out: `from_pretrained` and `save_pretrained`.

The file formats live in `bridge` (which knows nothing of our modules); this module turns a bridge parameter
dict (tree path -> numpy array) into an NNX model and back. Loading never builds a random model first: the
model is created abstractly (`nnx.eval_shape`) and filled tensor by tensor, so peak host memory stays close
to one copy of the weights.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bridge
from jaxft.config import ModelConfig
from jaxft.models.decoder import Decoder, abstract_model
from jaxft.models.families import family_for
from jaxft.models.layers import LoraParam


def _path_key(path) -> tuple[str, ...]:
    return tuple(str(p) for p in path)


def param_shapes(model: Decoder) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """Tree path -> shape/dtype of every base parameter (LoRA excluded)."""
    state = nnx.state(model, nnx.Not(LoraParam))
    out = {}
    for path, var in nnx.to_flat_state(state):
        if isinstance(var, nnx.Param):
            out[_path_key(path)] = jax.ShapeDtypeStruct(var.shape, var.dtype)
    return out


def from_pretrained(path: str | os.PathLike, dtype: str = "bfloat16", *, mesh=None) -> Decoder:
    """Loads an HF model directory (config.json + safetensors) into a jaxft `Decoder` in `dtype`.

    `mesh` (a `jaxft.sharding.Placement` or `MeshConfig`): every weight is built sharded by the rules
    (`jax.make_array_from_callback`), each device's shard read from the safetensors slices it holds, so no
    host or device ever holds a whole (sharded) weight."""
    path = Path(path)
    hf = bridge.read_config(path)
    cfg = ModelConfig.from_hf(hf, source=str(path / "config.json"))
    dtype = jnp.dtype(dtype)
    model = abstract_model(cfg, dtype=dtype)
    expected = param_shapes(model)
    if mesh is not None:
        return _sharded(model, path, cfg, expected, dtype, mesh)
    arrays = bridge.load_weights(path, family_for(cfg.model_type).table, expected, cfg.num_layers, dtype,
                                 num_experts=cfg.num_experts or None)
    graphdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    leaves = []
    for p, var in flat:
        key = _path_key(p)
        if key in arrays:
            # pop + wait: the host copy is released as soon as the device copy exists (peak ~ one copy plus
            # the largest tensor); without the wait the runtime keeps the host buffer alive until later.
            var = var.replace(jax.device_put(arrays.pop(key)).block_until_ready())
        leaves.append((p, var))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def model_params(model: Decoder, *, merge_lora: bool = True) -> dict[tuple[str, ...], np.ndarray]:
    """Base parameters as host arrays, with LoRA deltas merged into the kernels when present."""
    from jaxft.lora import merged_kernels  # local: lora imports io-free modules only

    merged = merged_kernels(model) if merge_lora else {}
    out = {}
    for key in param_shapes(model):
        if key in merged:
            out[key] = np.asarray(merged[key])
            continue
        node = model
        for part in key:
            node = getattr(node, part)
        out[key] = np.asarray(node[...])
    return out


def save_pretrained(model: Decoder, path: str | os.PathLike, *, dtype: str | None = None,
                    max_shard_bytes: int = 5 * 1024**3, overwrite: bool = False) -> Path:
    """Writes an HF directory (config.json + sharded safetensors + index); LoRA adapters are merged.

    The directory is written atomically (a temp dir renamed into place). An existing non-empty `path` is
    refused unless `overwrite=True`, which replaces it whole."""
    cfg: ModelConfig = model.config
    hf = cfg.to_hf()
    out_dtype = jnp.dtype(dtype) if dtype else model.dtype
    hf["dtype"] = str(out_dtype)
    params = {k: v.astype(out_dtype) for k, v in model_params(model).items()}
    bridge.save_weights(path, family_for(cfg.model_type).table, params, cfg.num_layers, hf,
                        max_shard_bytes=max_shard_bytes, overwrite=overwrite, num_experts=cfg.num_experts or None)
    return Path(path)


def _sharded(model: Decoder, path: Path, cfg: ModelConfig, expected, dtype, mesh) -> Decoder:
    from jaxft.sharding import MeshConfig, Placement

    placement = Placement(mesh) if isinstance(mesh, MeshConfig) else mesh
    graphdef, state = nnx.split(model)
    leaves = []
    with bridge.WeightSlices(path, family_for(cfg.model_type).table, expected, cfg.num_layers, dtype,
                             num_experts=cfg.num_experts or None) as source:
        for p, var in nnx.to_flat_state(state):
            key = _path_key(p)
            if key in expected:
                read = lambda index, key=key: source.read(key, index)  # noqa: E731  (one shard, on demand)
                value = jax.make_array_from_callback(var.shape, placement.sharding_of(var), read)
                var = var.replace(value.block_until_ready())
            leaves.append((p, var))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))
