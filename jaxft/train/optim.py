"""`OptimConfig`: the optimiser part of a run (AdamW with clipping and a transformers-style schedule; fp32 or 8-bit
moments, `jaxft.train.adam8bit`).

Field names are the flat `jaxft-train` / TRL keys, so an error names the key the user wrote. `build(total)`
gives the optax transformation and its schedule for a run of `total` optimizer steps.
"""

from __future__ import annotations

import dataclasses
import math

import optax

from jaxft.errors import KeyedConfigError
from jaxft.train.adam8bit import scale_by_adam_8bit
from jaxft.train.schedules import SCHEDULES, make_schedule, warmup_steps_for


class OptimConfigError(KeyedConfigError):
    """A bad optimiser setting; `field` is the key."""


# transformers' `optim` names -> whether AdamW's moments are 8-bit. Fused and paged variants are CUDA memory
# details of torch and bitsandbytes; here they are the same AdamW.
OPTIMIZERS = {"adamw_torch": False, "adamw_torch_fused": False, "adamw_8bit": True, "adamw_bnb_8bit": True,
              "paged_adamw_8bit": True}


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 2e-4
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # 0 disables clipping
    optim: str = "adamw_torch"

    def __post_init__(self):
        def need(ok: bool, field: str, what: str):
            if not ok:
                raise OptimConfigError(field, f"value {getattr(self, field)!r} is invalid; {what}")

        need(self.learning_rate > 0 and math.isfinite(self.learning_rate), "learning_rate", "must be > 0")
        need(self.lr_scheduler_type in SCHEDULES, "lr_scheduler_type", f"must be one of {', '.join(SCHEDULES)}")
        need(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        need(0.0 <= self.warmup_ratio < 1.0, "warmup_ratio", "must be in [0, 1)")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(0.0 <= self.adam_beta1 < 1.0, "adam_beta1", "must be in [0, 1)")
        need(0.0 <= self.adam_beta2 < 1.0, "adam_beta2", "must be in [0, 1)")
        need(self.adam_epsilon >= 0, "adam_epsilon", "must be >= 0")
        need(self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0 disables clipping)")
        need(self.optim in OPTIMIZERS, "optim", f"must be one of {', '.join(OPTIMIZERS)}")

    @property
    def eight_bit(self) -> bool:
        """Whether AdamW's moments are stored in 8 bits (`jaxft.train.adam8bit`)."""
        return OPTIMIZERS[self.optim]

    def warmup_for(self, total_steps: int) -> int:
        return warmup_steps_for(total_steps, self.warmup_steps, self.warmup_ratio)

    def build(self, total_steps: int, *, decay_mask=None) -> tuple[optax.GradientTransformation, optax.Schedule]:
        """(optimizer, schedule) for a run of `total_steps` updates; `decay_mask` as `make_optimizer` takes it."""
        schedule = make_schedule(self.lr_scheduler_type, self.learning_rate, total_steps,
                                 self.warmup_for(total_steps))
        return make_optimizer(schedule, b1=self.adam_beta1, b2=self.adam_beta2, eps=self.adam_epsilon,
                              weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm,
                              decay_mask=decay_mask, eight_bit=self.eight_bit), schedule


def make_optimizer(schedule: optax.Schedule | float, *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                   decay_mask=None, eight_bit: bool = False) -> optax.GradientTransformation:
    """AdamW (decoupled decay: p <- p - lr * (adam_update + weight_decay * p), as torch.optim.AdamW), after
    global-norm clipping of the gradient to `max_grad_norm` (0 = no clipping). `decay_mask` (optax's `mask`: a
    function of the parameters giving a tree of bools) limits the decay to the True leaves; None decays every one
    (a LoRA run's adapters, as transformers' Trainer decays them). `eight_bit` keeps the moments in 8 bits
    (`jaxft.train.adam8bit`); the update is otherwise the same."""
    if eight_bit:
        adamw = optax.chain(scale_by_adam_8bit(b1, b2, eps), optax.add_decayed_weights(weight_decay, decay_mask),
                            optax.scale_by_learning_rate(schedule))
    else:
        adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)
    if max_grad_norm and max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)
    return adamw
