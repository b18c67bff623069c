"""Direct preference optimisation (DPO) of the LoRA adapters: the objective `jaxft-train` runs with `trainer: dpo`.

For a preference pair (prompt x, chosen y_w, rejected y_l), with log pi(y|x) the summed log-probability of the
completion tokens (the mask of `jaxft.data.preference`) under the policy (the model with its adapters) and
log pi_ref(y|x) under the reference, the same model with its adapters switched off:

    delta = (log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))
    sigmoid:  l = -log sigmoid(beta * delta)                                               (DPO)
    robust:   l = (-(1 - e) log sigmoid(beta * delta) + e log sigmoid(-beta * delta)) / (1 - 2e)   (e: label_smoothing)
    hinge:    l = max(0, 1 - beta * delta)                                             (SLiC)
    ipo:      l = (delta' - 1 / (2 beta))^2, delta' as delta with each log-ratio divided by its completion's
              token count                                                              (IPO, TRL's normalisation)

and the step's loss is the mean of l over its pairs (TRL's `DPOTrainer` loss types of those names). Metrics, means
over the pairs (TRL's names): rewards/chosen = beta (log pi(y_w|x) - log pi_ref(y_w|x)), rewards/rejected likewise,
rewards/margins their difference, rewards/accuracies the fraction with chosen > rejected reward, logps/chosen and
logps/rejected the policy's log-probabilities.

The reference needs no second copy of the weights: the LoRA scales (`LoraScale`, per-layer constants of the frozen
state) are zeroed, which makes every adapter add exactly 0. It is run once per micro-batch, without gradient.

One policy forward scores both sides of every pair (a row holds whole pairs, `jaxft.data.preference`). The loss
is a nonlinear function of per-sequence sums of token log-probabilities, and the head's cross-entropy is a weighted
sum that never holds the [tokens, vocab] logits (`kernels_pallas.linear_cross_entropy`). So: the per-token CE
comes from the head with the hidden states held constant (the gradient of the weighted sum w.r.t. its weights is
each token's CE), the pair losses and their gradients g w.r.t. each sequence's log-probability follow on [pairs]
arrays, and the gradient reaches the model through the weighted sum with weights -g of each token's sequence:
d/dtheta sum_t w_t CE_t = sum_s g_s d log pi_s / dtheta. The head runs twice in the forward (a few per cent of a
step for a 128k vocabulary); nothing of [tokens, vocab] is kept.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxft.errors import KeyedConfigError
from jaxft.memory.execution import ExecutionConfig
from jaxft.models.layers import LoraScale
from jaxft.train.step import TRAIN_EXECUTION, head_cross_entropy, model_inputs

LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")
_F32 = jnp.float32


class DpoConfigError(KeyedConfigError):
    """A bad DPO setting; `field` is the key."""


@dataclasses.dataclass(frozen=True)
class DpoConfig:
    """The DPO objective (TRL's `DPOConfig` names): `beta` the strength of the pull towards the reference,
    `loss_type` sigmoid (DPO), robust (label noise `label_smoothing`, in [0, 0.5)), hinge or ipo."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    count_name = "num_pairs"  # what the step's loss is a mean over

    def __post_init__(self):
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise DpoConfigError("beta", f"value {self.beta!r} is invalid; must be > 0 (TRL's default: 0.1)")
        if self.loss_type not in LOSS_TYPES:
            raise DpoConfigError("loss_type", f"value {self.loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise DpoConfigError("label_smoothing", f"value {self.label_smoothing!r} is invalid; must be in [0, 0.5) "
                                 "(the probability that a preference label is flipped)")
        if self.label_smoothing and self.loss_type != "robust":
            raise DpoConfigError("label_smoothing", f"value {self.label_smoothing!r} with loss_type "
                                 f"{self.loss_type}, which has no label smoothing (TRL ignores it there); set "
                                 "loss_type: robust for the label-noise-robust loss, or drop label_smoothing")

    # ------------------------------------------------------------------ the math on [pairs]
    def pair_losses(self, chosen, rejected, ref_chosen, ref_rejected, lengths) -> jax.Array:
        """l of each pair (module docstring) from the four log-probabilities and the (chosen, rejected) completion
        token counts `lengths` (which only ipo reads)."""
        if self.loss_type == "ipo":
            n_chosen, n_rejected = (jnp.maximum(n, 1.0) for n in lengths)
            delta = (chosen - ref_chosen) / n_chosen - (rejected - ref_rejected) / n_rejected
            return (delta - 1 / (2 * self.beta)) ** 2
        z = self.beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
        if self.loss_type == "sigmoid":
            return -jax.nn.log_sigmoid(z)
        if self.loss_type == "hinge":
            return jax.nn.relu(1 - z)
        e = self.label_smoothing
        return (-(1 - e) * jax.nn.log_sigmoid(z) + e * jax.nn.log_sigmoid(-z)) / (1 - 2 * e)

    def _metric_sums(self, valid, chosen, rejected, ref_chosen, ref_rejected) -> dict[str, jax.Array]:
        rc, rr = self.beta * (chosen - ref_chosen), self.beta * (rejected - ref_rejected)
        values = {"rewards/chosen": rc, "rewards/rejected": rr, "rewards/margins": rc - rr,
                  "rewards/accuracies": (rc > rr).astype(_F32), "logps/chosen": chosen, "logps/rejected": rejected}
        return {k: jnp.sum(jnp.where(valid, v, 0.0)) for k, v in values.items()}

    # ------------------------------------------------------------------ the step's sums
    def loss_and_grad_sums(self, graphdef: nnx.GraphDef, lora: nnx.State, frozen: nnx.State, batch,
                           rng: jax.Array | None, execution: ExecutionConfig = TRAIN_EXECUTION):
        """(sum of pair losses, sum of their gradients w.r.t. `lora`, pair count, metric sums) over `batch` of
        [A, B, T] leaves (A micro-batches scanned, as `jaxft.train.step.loss_and_grad_sums`)."""
        accum = batch["loss_mask"].shape[0]
        reference = adapters_off(frozen)
        forward_only = execution.replace(remat="none")

        def micro(lora_, mb, r, ref):
            model = nnx.merge(graphdef, lora_, frozen)
            args, images = model_inputs(model, mb)
            hidden = model.hidden_states(*args, dropout_rng=r, execution=execution, **images)
            seg, mask = mb["segment_ids"], mb["loss_mask"].astype(_F32)
            chosen, rejected = _pairs(_sequence_sums(-_token_ce(model, hidden, mb, execution), seg))
            lengths, valid = _completion_lengths(mask, seg)

            def total(c, r_):
                return jnp.sum(jnp.where(valid, self.pair_losses(c, r_, *ref, lengths), 0.0))

            loss, (g_chosen, g_rejected) = jax.value_and_grad(total, argnums=(0, 1))(chosen, rejected)
            coef = _unpairs(g_chosen, g_rejected, seg.shape[1])
            weights = jax.lax.stop_gradient(-jnp.take_along_axis(coef, seg, axis=1) * mask)
            surrogate = head_cross_entropy(model, hidden, mb["targets"], weights, execution)
            # The value is the loss; the gradient is the surrogate's, which is the loss's (module docstring).
            value = surrogate + jax.lax.stop_gradient(loss - surrogate)
            return value, (jnp.sum(valid).astype(_F32), self._metric_sums(valid, chosen, rejected, *ref))

        grad_fn = jax.value_and_grad(micro, has_aux=True)

        def body(carry, xs):
            loss_acc, grad_acc, count_acc, metric_acc = carry
            mb, index = xs
            r = None if rng is None else jax.random.fold_in(rng, index)
            ref = self._logps(nnx.merge(graphdef, lora, reference), mb, forward_only)
            (loss, (count, metrics)), grads = grad_fn(lora, mb, r, ref)
            return (loss_acc + loss, jax.tree.map(jnp.add, grad_acc, grads), count_acc + count,
                    jax.tree.map(jnp.add, metric_acc, metrics)), None

        zero = jnp.zeros((), _F32)
        init = (zero, jax.tree.map(lambda x: jnp.zeros(x.shape, _F32), lora), zero, {k: zero for k in METRICS})
        (loss_sum, grad_sum, count, metrics), _ = jax.lax.scan(body, init, (batch, jnp.arange(accum, dtype=jnp.int32)))
        return loss_sum, grad_sum, count, metrics

    def eval_sums(self, graphdef: nnx.GraphDef, lora: nnx.State, frozen: nnx.State, batch,
                  execution: ExecutionConfig = TRAIN_EXECUTION) -> tuple[jax.Array, jax.Array, dict]:
        """(sum of pair losses, pair count, metric sums) of a [B, T] batch, no gradient."""
        ref = self._logps(nnx.merge(graphdef, lora, adapters_off(frozen)), batch, execution)
        chosen, rejected = self._logps(nnx.merge(graphdef, lora, frozen), batch, execution)
        lengths, valid = _completion_lengths(batch["loss_mask"].astype(_F32), batch["segment_ids"])
        loss = jnp.sum(jnp.where(valid, self.pair_losses(chosen, rejected, *ref, lengths), 0.0))
        return loss, jnp.sum(valid).astype(_F32), self._metric_sums(valid, chosen, rejected, *ref)

    def _logps(self, model, batch, execution: ExecutionConfig) -> tuple[jax.Array, jax.Array]:
        """(chosen, rejected) summed completion log-probabilities [B, P] of `model` (no gradient, no dropout)."""
        args, images = model_inputs(model, batch)
        hidden = model.hidden_states(*args, execution=execution, **images)
        return _pairs(_sequence_sums(-_token_ce(model, hidden, batch, execution), batch["segment_ids"]))


def adapters_off(frozen: nnx.State) -> nnx.State:
    """`frozen` with every LoRA scale 0: the model it merges into computes the base model exactly (each adapter
    adds x A (0 B) = 0), for the price of the scales' few bytes."""
    def off(v):
        if isinstance(v, LoraScale):
            return v.replace(jax.tree.map(jnp.zeros_like, v.get_value()))
        return v
    return jax.tree.map(off, frozen, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _token_ce(model, hidden: jax.Array, batch, execution: ExecutionConfig) -> jax.Array:
    """[B, T] cross-entropy of each trained target (0 elsewhere), constant w.r.t. the model: the gradient of the
    head's weighted CE sum w.r.t. its weights, with the hidden states held constant (one pass over the logits)."""
    hidden = jax.lax.stop_gradient(hidden)
    mask = batch["loss_mask"].astype(_F32)
    _, vjp = jax.vjp(lambda w: head_cross_entropy(model, hidden, batch["targets"], w, execution), mask)
    (ce,) = vjp(jnp.ones((), _F32))
    return jax.lax.stop_gradient(ce) * mask


def _sequence_sums(values: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """[B, T] -> [B, T + 1]: column j the sum over row r's document j (segment ids are 1-based, 0 is padding)."""
    b, t = values.shape
    return jnp.zeros((b, t + 1), _F32).at[jnp.arange(b)[:, None], segment_ids].add(values.astype(_F32))


def _pairs(sums: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, T + 1] per-document sums -> (chosen, rejected) [B, T // 2]: pair k is documents 2k+1 and 2k+2."""
    p = (sums.shape[1] - 1) // 2
    return sums[:, 1:2 * p:2], sums[:, 2:2 * p + 1:2]


def _unpairs(chosen: jax.Array, rejected: jax.Array, t: int) -> jax.Array:
    """The inverse of `_pairs`: [B, P] twice -> [B, T + 1] per-document values (0 for padding and unused)."""
    b, p = chosen.shape
    out = jnp.zeros((b, t + 1), _F32)
    return out.at[:, 1:2 * p:2].set(chosen).at[:, 2:2 * p + 1:2].set(rejected)


def _completion_lengths(mask: jax.Array, segment_ids: jax.Array) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """((chosen, rejected) completion token counts [B, P], whether pair k of each row exists: both of its
    sequences have completion targets)."""
    chosen, rejected = _pairs(_sequence_sums(mask, segment_ids))
    return (chosen, rejected), (chosen > 0) & (rejected > 0)
