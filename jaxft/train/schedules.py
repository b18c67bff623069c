"""Learning-rate schedules with transformers' (`get_scheduler`) formulas, as optax schedules.

With `s` the number of optimizer updates already applied (optax's `count`: the first update uses s=0),
`W` warmup steps and `N` total steps, the learning rate is `lr * f(s)`:

    warmup (s < W):        f = s / max(1, W)
    linear:                f = max(0, (N - s) / max(1, N - W))
    cosine:                f = max(0, 0.5 * (1 + cos(pi * (s - W) / max(1, N - W))))
    constant:              f = 1                     (no warmup, as transformers' "constant")
    constant_with_warmup:  f = 1 after warmup
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import optax

SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")


def warmup_steps_for(total_steps: int, warmup_steps: int = 0, warmup_ratio: float = 0.0) -> int:
    """`warmup_steps` when > 0, else ceil(warmup_ratio * total_steps) (transformers' rule)."""
    return int(warmup_steps) if warmup_steps > 0 else int(math.ceil(total_steps * warmup_ratio))


def lr_factor(kind: str, step, total_steps: int, warmup_steps: int):
    """The multiplier f(step) of the module docstring; `step` is a scalar (jnp or Python number)."""
    if kind not in SCHEDULES:
        raise ValueError(f"lr_scheduler_type={kind!r} is not one of {SCHEDULES}")
    s = jnp.asarray(step, jnp.float32)
    if kind == "constant":
        return jnp.ones_like(s)
    w, n = float(warmup_steps), float(total_steps)
    warm = s / max(1.0, w)
    if kind == "constant_with_warmup":
        after = jnp.ones_like(s)
    elif kind == "linear":
        after = jnp.maximum(0.0, (n - s) / max(1.0, n - w))
    else:  # cosine
        progress = (s - w) / max(1.0, n - w)
        after = jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(jnp.pi * progress)))
    return jnp.where(s < w, warm, after)


def make_schedule(kind: str, learning_rate: float, total_steps: int, warmup_steps: int) -> optax.Schedule:
    """An optax schedule `count -> learning rate` (see the module docstring)."""
    if kind not in SCHEDULES:
        raise ValueError(f"lr_scheduler_type={kind!r} is not one of {SCHEDULES}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    return lambda count: learning_rate * lr_factor(kind, count, total_steps, warmup_steps)
