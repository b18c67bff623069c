"""The jitted training and evaluation steps.

Loss of one optimizer step over micro-batches m = 1..A (gradient accumulation) of packed rows:

    L = sum_m sum_{t in m} w_t * CE_t  /  sum_m sum_{t in m} w_t          (w_t = loss_mask, 1 on target tokens)
    dL/dθ = (sum_m d(sum_{t in m} w_t CE_t)/dθ) / sum_m sum_{t in m} w_t

Summed losses and summed gradients are accumulated over the micro-batches (a `lax.scan` inside the one
jitted step) and divided once by the global target count, so A micro-batches of B rows give exactly the
loss and gradient of one batch of A*B rows (up to float summation order).

MoE models whose config asks for the router load-balancing loss (`ModelConfig.router_aux_loss_coef`, from
config.json's output_router_logits / router_aux_loss_coef) add c * aux_m per micro-batch, as transformers adds
c * aux to its mean CE per forward pass:

    L = (sum of w_t CE_t) / (sum of w_t)  +  c * mean_m aux_m

(aux_m: `jaxft.models.moe.load_balancing_loss` over micro-batch m's non-padding tokens; with one micro-batch
this is transformers' `outputs.loss`). It enters each micro-batch's summed objective as c * aux_m * N / A
(N the step's target count), so the one division by N gives L. Other models' numbers are unchanged. CE comes from
`kernels_pallas.linear_cross_entropy` on the final hidden states: the [tokens, vocab] fp32 logits are
never materialised.

Only `TrainableParam` variables (LoRA matrices, and tables or token rows trained beside them) are differentiated
and optimised: the model is split by variable type, `graphdef, lora, frozen = nnx.split(model, TrainableParam,
...)`; the step takes `lora` and the optimizer state as donated buffers (updated in place) and `frozen` (base
weights, LoRA scales) as a read-only input. A full fine-tune (`jaxft.train.full`) splits off every `nnx.Param`
instead, as fp32 master weights, and passes `cast` (the masters to the compute dtype before each forward).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxft.memory.execution import ExecutionConfig
from jaxft.models.layers import TrainableParam
from jaxft.models.stack import STACK_NAMES
from jaxft.models.moe import load_balancing_loss
from kernels_pallas.linear_cross_entropy import linear_cross_entropy

Batch = dict[str, jax.Array]
BATCH_KEYS = ("input_ids", "targets", "loss_mask", "segment_ids", "positions")
# Batches of documents with images (vision-language models) also hold these, per row (`jaxft.data.packing`).
IMAGE_KEYS = ("pixel_values", "image_grid_thw")
TRAIN_EXECUTION = ExecutionConfig()  # attention "auto" (per device and batch), no remat


def split_model(model: nnx.Module, trainable: type = TrainableParam) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, lora, frozen): the trainable variables (LoRA matrices, trained tables and rows; with
    `trainable=nnx.Param`, every weight) and everything else, selected by type."""
    graphdef, lora, frozen = nnx.split(model, trainable, ...)
    if not jax.tree.leaves(lora):
        raise ValueError("the model has no trainable variables: apply LoRA (jaxft.lora.apply_lora) before training")
    return graphdef, lora, frozen


def unstack_layers(frozen: nnx.State, *, delete_source: bool = False) -> nnx.State:
    """`frozen` with every stacked per-layer weight [L, ...] (of every layer stack, `jaxft.models.stack`)
    replaced by a tuple of L arrays.

    The decoder then runs its layers unrolled (see `jaxft.models.decoder.is_unstacked`) and every matmul
    reads its own weight buffer. A layer scan instead slices each layer's weights out of the stacked arrays,
    which XLA does as a copy: all frozen weights are copied once in the forward and once in the backward
    pass (about 20 ms per step for an 8B model). The LoRA parameters stay stacked (their slices
    are small). `delete_source` frees each stacked array once its slices exist, so the extra device memory
    is one stacked array at a time; the caller must not use the model it came from afterwards.
    """
    out = []
    for path, var in nnx.to_flat_state(frozen):
        value = var.get_value()
        if path[0] in STACK_NAMES and isinstance(value, jax.ShapeDtypeStruct) and value.ndim >= 1:
            # An abstract state (nnx.eval_shape): the same structure, for ahead-of-time compilation.
            var = var.replace(tuple(jax.ShapeDtypeStruct(value.shape[1:], value.dtype)
                                    for _ in range(value.shape[0])))
        elif path[0] in STACK_NAMES and isinstance(value, jax.Array) and value.ndim >= 1:
            parts = tuple(value[i] for i in range(value.shape[0]))
            jax.block_until_ready(parts)
            if delete_source:
                value.delete()
            var = var.replace(parts)
        out.append((path, var))
    return nnx.from_flat_state(out)


def restack_layers(frozen: nnx.State, *, delete_source: bool = False) -> nnx.State:
    """The inverse of `unstack_layers`: tuples of per-layer arrays stacked back into [L, ...] arrays (what
    export, merging and checkpoint formats expect)."""
    out = []
    for path, var in nnx.to_flat_state(frozen):
        value = var.get_value()
        if isinstance(value, tuple):
            stacked = jnp.stack(value)
            jax.block_until_ready(stacked)
            if delete_source:
                for part in value:
                    part.delete()
            var = var.replace(stacked)
        out.append((path, var))
    return nnx.from_flat_state(out)


def has_router_aux_loss(model) -> bool:
    """Whether the model's training objective includes the router load-balancing loss."""
    return model.config.router_aux_loss_coef is not None


def token_loss_sum(model, batch: Batch, *, dropout_rng: jax.Array | None = None,
                   execution: ExecutionConfig = TRAIN_EXECUTION, aux_weight: jax.Array | None = None) -> jax.Array:
    """sum_t loss_mask_t * CE(softmax(softcap(h_t @ W_head)), targets_t) over a [B, T] packed batch (fp32
    scalar); softcap is the model's final logit softcap (Gemma 2), the identity when it has none.

    With `aux_weight` on a model that has the router aux loss, adds coef * aux * aux_weight (see the module
    docstring); otherwise `aux_weight` is ignored."""
    args, images = model_inputs(model, batch)
    aux = None
    if aux_weight is not None and has_router_aux_loss(model):
        hidden, stats, rows = model.hidden_states_and_router_stats(*args, dropout_rng=dropout_rng,
                                                                   execution=execution)
        with jax.named_scope("router_aux_loss"):
            aux = model.config.router_aux_loss_coef * load_balancing_loss(stats, jnp.maximum(rows, 1.0)) * aux_weight
    else:
        hidden = model.hidden_states(*args, dropout_rng=dropout_rng, execution=execution, **images)
    ce = _ce_sum(model, hidden, batch, execution)
    return ce if aux is None else ce + aux


def model_inputs(model, batch: Batch) -> tuple[tuple, dict[str, jax.Array]]:
    """(input_ids, positions, segment_ids) and the image inputs of a packed batch for `model`. A vision-language
    model gets no positions (it computes its M-RoPE positions from the ids, the segments and the image grids)
    and its images per row (`pixel_rows`, `grid_rows`: on a mesh each device embeds its own rows' images,
    `jaxft.models.vision.model.per_device_images`)."""
    if getattr(model.config, "vision", None) is None:
        return (batch["input_ids"], batch["positions"], batch["segment_ids"]), {}
    images = {}
    if "pixel_values" in batch:
        images = dict(pixel_rows=batch["pixel_values"], grid_rows=batch["image_grid_thw"])
    return (batch["input_ids"], None, batch["segment_ids"]), images


def _ce_sum(model, hidden, batch: Batch, execution: ExecutionConfig) -> jax.Array:
    return head_cross_entropy(model, hidden, batch["targets"], batch["loss_mask"], execution)


def head_cross_entropy(model, hidden: jax.Array, targets: jax.Array, weights: jax.Array,
                       execution: ExecutionConfig = TRAIN_EXECUTION) -> jax.Array:
    """sum_t weights_t * CE(softmax(softcap(h_t @ W_head)), targets_t) over [B, T] `hidden` (fp32 scalar), the
    [tokens, vocab] logits never materialised (`linear_cross_entropy`); differentiable w.r.t. `hidden` and
    `weights` (whose gradient is each token's CE)."""
    b, t, h = hidden.shape
    weight, layout = model.head_weight()
    with jax.named_scope("cross_entropy"):
        return linear_cross_entropy(
            hidden.reshape(b * t, h), weight, targets.reshape(b * t), weights.reshape(b * t).astype(jnp.float32),
            logit_softcap=model.config.final_logit_softcap,
            chunk_size=execution.resolved_ce_chunk(b * t, model.config.vocab_size, h, hidden.dtype.itemsize),
            implementation=execution.ce_implementation, weight_layout=layout)


def loss_and_grad_sums(graphdef: nnx.GraphDef, lora: nnx.State, frozen: nnx.State, batch: Batch,
                       rng: jax.Array | None, execution: ExecutionConfig = TRAIN_EXECUTION,
                       cast: Callable | None = None) -> tuple[jax.Array, Any, jax.Array]:
    """(sum of token losses, sum of their gradients w.r.t. `lora`, target count) over `batch` whose leaves are
    [A, B, T] (A micro-batches, scanned one at a time so only one micro-batch's activations are live). `cast`
    maps the trainable state to what the model computes with (differentiated through); None: as it is."""

    accum = batch["loss_mask"].shape[0]
    count = jnp.sum(batch["loss_mask"].astype(jnp.float32))
    aux_weight = count / accum  # c * aux_m * N / A per micro-batch: c * mean_m aux_m once divided by N

    def micro_loss(lora_, mb, r):
        model = nnx.merge(graphdef, lora_ if cast is None else cast(lora_), frozen)
        return token_loss_sum(model, mb, dropout_rng=r, execution=execution, aux_weight=aux_weight)

    grad_fn = jax.value_and_grad(micro_loss)

    def body(carry, xs):
        loss_acc, grad_acc = carry
        mb, index = xs
        r = None if rng is None else jax.random.fold_in(rng, index)
        loss, grads = grad_fn(lora, mb, r)
        return (loss_acc + loss, jax.tree.map(jnp.add, grad_acc, grads)), None

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), lora)
    init = (jnp.zeros((), jnp.float32), zeros)
    (loss_sum, grad_sum), _ = jax.lax.scan(body, init, (batch, jnp.arange(accum, dtype=jnp.int32)))
    return loss_sum, grad_sum, count


def _check_objective(objective, cast: Callable | None) -> None:
    if objective is not None and cast is not None:
        raise ValueError("an objective other than cross-entropy (DPO) trains LoRA adapters, whose reference is the "
                         "model with them off; it takes no cast of fully trained weights")


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule | None = None, *, execution: ExecutionConfig = TRAIN_EXECUTION,
                    dropout: bool = False, donate: bool = True, in_shardings=None, out_shardings=None,
                    cast: Callable | None = None, objective=None) -> Callable:
    """`step(lora, opt_state, frozen, batch [A,B,T], rng) -> (lora, opt_state, metrics)`, jitted once.

    `lora` and `opt_state` are donated. metrics: loss (mean over the step's target tokens), grad_norm (global
    norm before clipping), learning_rate (used by this update), num_target_tokens. `rng` drives LoRA dropout
    (one key per micro-batch via fold_in); it is ignored unless `dropout`. `execution` says how the step runs
    (attention kernel, remat policy, CE chunk; its `compiler_options` apply to this program only, never as
    process-wide flags). `in_shardings` / `out_shardings` (for the five arguments and the three outputs) place
    the step on a mesh (`jaxft.sharding.Placement`); XLA inserts the collectives. `cast`: see
    `loss_and_grad_sums`. `objective`: another training objective than token cross-entropy
    (`jaxft.train.dpo.DpoConfig`): its `loss_and_grad_sums` gives the sums and the count the loss is a mean over,
    and its metrics (means over that count) join the step's; it trains adapters, so takes no `cast`."""
    _check_objective(objective, cast)

    def step(lora, opt_state, frozen, batch, rng):
        r = rng if dropout else None
        extra = {}
        if objective is None:
            loss_sum, grad_sum, count = loss_and_grad_sums(graphdef, lora, frozen, batch, r, execution, cast)
        else:
            loss_sum, grad_sum, count, extra = objective.loss_and_grad_sums(graphdef, lora, frozen, batch, r,
                                                                            execution)
        denom = jnp.maximum(count, 1.0)  # an all-padding step has zero loss and zero gradient
        grads = jax.tree.map(lambda g: g / denom, grad_sum)
        metrics = {"loss": loss_sum / denom, "grad_norm": optax.tree.norm(grads), "num_target_tokens": count}
        if objective is not None:
            metrics.update({k: v / denom for k, v in extra.items()})
            metrics["num_target_tokens"] = jnp.sum(batch["loss_mask"].astype(jnp.float32))
            metrics[objective.count_name] = count
        if schedule is not None:
            metrics["learning_rate"] = jnp.asarray(schedule(_update_count(opt_state)), jnp.float32)
        with jax.named_scope("optimizer"):
            updates, opt_state = optimizer.update(grads, opt_state, lora)
            lora = optax.apply_updates(lora, updates)
        return lora, opt_state, metrics

    shardings = {} if in_shardings is None else dict(in_shardings=in_shardings, out_shardings=out_shardings)
    return jax.jit(step, donate_argnums=(0, 1) if donate else (),
                   compiler_options=execution.program_options or None, **shardings)


def make_eval_step(graphdef: nnx.GraphDef, *, execution: ExecutionConfig = TRAIN_EXECUTION,
                   cast: Callable | None = None, objective=None) -> Callable:
    """`eval_step(lora, frozen, batch [B,T]) -> (loss_sum, target_count)`; the eval loss is
    sum(loss_sum) / sum(target_count) over all eval batches. `cast`: see `loss_and_grad_sums`. With an
    `objective` (see `make_train_step`), its loss sum and count (e.g. DPO: preference pairs) and a third output,
    its metrics' sums over that count."""
    _check_objective(objective, cast)

    def eval_step(lora, frozen, batch):
        if objective is not None:
            return objective.eval_sums(graphdef, lora, frozen, batch, execution.replace(remat="none"))
        model = nnx.merge(graphdef, lora if cast is None else cast(lora), frozen)
        count = jnp.sum(batch["loss_mask"].astype(jnp.float32))
        # No backward: no remat. The router aux loss (if any) is weighted by the batch's targets, so the eval
        # loss is the CE mean plus c times the target-weighted mean of the batches' aux losses.
        loss = token_loss_sum(model, batch, execution=execution.replace(remat="none"), aux_weight=count)
        return loss, count

    return jax.jit(eval_step)


def _update_count(opt_state) -> jax.Array:
    """The number of updates applied so far, read from the optimizer state (optax's ScaleByScheduleState)."""
    for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState)):
        if isinstance(leaf, optax.ScaleByScheduleState):
            return leaf.count
    raise ValueError("the optimizer has no learning-rate schedule state; pass schedule=None to make_train_step")


def stack_micro_batches(batch: dict[str, Any], accum: int) -> dict[str, Any]:
    """[A*B, T] host arrays -> [A, B, T] (micro-batch m = rows m*B .. m*B+B-1)."""
    out = {}
    for key in BATCH_KEYS + tuple(k for k in IMAGE_KEYS if k in batch):
        x = batch[key]
        if x.shape[0] % accum:
            raise ValueError(f"batch[{key!r}] has {x.shape[0]} rows, not a multiple of gradient_accumulation_steps="
                             f"{accum}")
        out[key] = x.reshape(accum, x.shape[0] // accum, *x.shape[1:])
    return out
