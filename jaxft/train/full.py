"""Full fine-tuning (`finetuning_type: full`): every weight of the model trained, no adapter.

What is trained is chosen by variable type, as for LoRA: every `nnx.Param` (linear kernels and biases, norms,
embeddings, head, routers, expert stacks) is split off as the trainable state; the non-`Param` variables (4-bit
or FP8 storage, which full fine-tuning refuses) would stay frozen.

Precision: the trainable state holds fp32 master weights and AdamW's fp32 moments; a bf16 run casts the masters to
bf16 at the start of each micro-batch's forward (`caster`), so the model computes on exactly the weights a
bf16 checkpoint holds and the gradient of the cast brings each weight's bf16 gradient back to fp32, where it
is accumulated. Per parameter: 4 bytes master + 4 gradient + 8 moments, plus the bf16 copy of the step (2).
An fp32 run (`bf16: false`) casts nothing. Exports write the cast weights: a bf16 run's checkpoint is bf16.

Weight decay follows transformers' Trainer (`get_decay_parameter_names`): no decay on biases (a variable whose
name holds "bias") and on the parameters of norm layers (`RMSNorm`, the vision tower's `LayerNorm`, by type).

The layer loop is the scan: per-layer weight buffers (`layer_loop: unroll`) exist to spare the frozen weights'
slice copies, and a trained weight is copied by its cast anyway; frozen weights streamed from host memory
(`frozen_weights: host`) have nothing to stream, every weight being trained on the device.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxft.memory.execution import ExecutionConfig, ExecutionConfigError
from jaxft.models.parts import RMSNorm
from jaxft.models.vision.tower import LayerNorm

FINETUNING_TYPES = ("lora", "full")
# The variable type a full fine-tune trains (`jaxft.train.step.split_model(model, TRAINED_TYPE)`).
TRAINED_TYPE = nnx.Param
NORM_TYPES = (RMSNorm, LayerNorm)


def full_execution(execution: ExecutionConfig) -> ExecutionConfig:
    """`execution` as a full fine-tune runs it: the layer scan (an "auto" loop), weights on the device (an "auto"
    frozen_weights); settings that need per-layer weight buffers or streamed frozen weights are an
    `ExecutionConfigError` naming the field."""
    if execution.layer_loop == "unroll" or execution.needs_unrolled_layers:
        field = "layer_loop" if execution.layer_loop == "unroll" else (
            "remat_layers" if execution.remat_layers is not None else "offload_transfer")
        raise ExecutionConfigError(field, "needs the unrolled layer loop, and full fine-tuning runs the layer scan "
                                          "(every weight is trained); drop it")
    if execution.frozen_weights == "host":
        raise ExecutionConfigError("frozen_weights", "'host' streams frozen weights, and full fine-tuning trains "
                                                     "every weight on the device; set frozen_weights: device")
    return execution.replace(layer_loop="scan", frozen_weights="device")


def compute_dtypes(state: nnx.State) -> nnx.State:
    """The dtype of every array of an (abstract) trainable state: what the model computes with."""
    return jax.tree.map(lambda x: jnp.dtype(x.dtype), state)


def to_master(state: nnx.State, *, delete_source: bool = False) -> nnx.State:
    """`state` with every floating array in fp32 (arrays or shapes); `delete_source` frees each source array once
    its copy exists, so a load holds one extra array at a time."""
    def master(x):
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.float32:
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding)
        out = x.astype(jnp.float32)
        if delete_source and isinstance(x, jax.Array):
            jax.block_until_ready(out)
            x.delete()
        return out
    return jax.tree.map(master, state)


def caster(dtypes: nnx.State) -> Callable[[nnx.State], nnx.State] | None:
    """The function the step applies to the fp32 masters before the forward (each array to its compute dtype),
    or None when they compute in fp32 already."""
    if all(d == jnp.float32 or not jnp.issubdtype(d, jnp.floating) for d in jax.tree.leaves(dtypes)):
        return None

    def cast(state: nnx.State) -> nnx.State:
        return jax.tree.map(lambda x, d: x.astype(d), state, dtypes)
    return cast


def _names(path) -> tuple[str, ...]:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
    return tuple(out)


def decay_mask(model: nnx.Module) -> Callable[[Any], Any]:
    """optax's `mask` for AdamW's weight decay on `model`'s trainable state: True where transformers' Trainer
    decays (see the module docstring). Only the module paths are read from `model` (an abstract one will do)."""
    norms = {tuple(str(p) for p in path) for path, node in nnx.iter_graph(model) if isinstance(node, NORM_TYPES)}

    def decays(path) -> bool:
        names = _names(path)
        if any(names[:k] in norms for k in range(1, len(names) + 1)):
            return False
        return not any("bias" in n for n in names[-2:])  # the variable's name (a state leaf may end in "value")

    return lambda params: jax.tree_util.tree_map_with_path(lambda path, _: decays(path), params)
