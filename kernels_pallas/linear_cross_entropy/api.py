"""Public entry point: cross-entropy of a linear head without full logits.

    loss = sum_i weights_i * CE_i,
    CE_i = logsumexp_j z_ij - z_i,targets_i,
    z_i  = softcap(hidden_i @ weight)     (fp32 accumulation)

with ``softcap(x) = c * tanh(x / c)`` when ``logit_softcap = c`` is set and the
identity otherwise.  See ``reference.py`` for the naive definition and
``xla.py`` for the chunked algorithm and its gradient.  ``OP`` is the op's
registry (names as in ``kernels_pallas/_dispatch.py``): "xla" (chunked, custom
VJP) and "reference" (full logits, autodiff); "auto"/None picks "xla".
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

from kernels_pallas._dispatch import ALL_PLATFORMS, Implementation, Op

from .config import tiles_for
from .reference import linear_cross_entropy_reference
from .xla import LAYOUTS, linear_cross_entropy_xla, vocab_axis

_WHERE = "kernels_pallas/linear_cross_entropy/api.py: linear_cross_entropy"


def _run_reference(hidden, weight, targets, weights, *, logit_softcap, chunk_size, weight_layout):
    del chunk_size  # one [N, V] block by definition
    return linear_cross_entropy_reference(hidden, weight, targets, weights, logit_softcap=logit_softcap,
                                          weight_layout=weight_layout)


def _run_xla(hidden, weight, targets, weights, *, logit_softcap, chunk_size, weight_layout):
    n, vocab = hidden.shape[0], weight.shape[vocab_axis(weight_layout)]
    if chunk_size is None:
        chunk_size = tiles_for(jax.devices()[0].device_kind, n, vocab)
    return linear_cross_entropy_xla(
        hidden, weight, targets, weights, chunk_size=min(int(chunk_size), n), logit_softcap=logit_softcap,
        weight_layout=weight_layout,
    )


OP = Op(
    name="linear_cross_entropy",
    where="kernels_pallas/linear_cross_entropy/api.py",
    implementations=(
        Implementation("reference", _run_reference, ALL_PLATFORMS, summary="full [N, V] fp32 logits"),
        Implementation("xla", _run_xla, ALL_PLATFORMS, summary="token chunks, custom VJP"),
    ),
    auto_order=("xla", "reference"),
)
IMPLEMENTATIONS = OP.accepted


@dataclasses.dataclass(frozen=True)
class _Options:
    """Static (trace-time) options, validated once."""

    logit_softcap: float | None
    chunk_size: int | None
    implementation: str | None
    weight_layout: str = "hv"

    def __post_init__(self) -> None:
        cap = self.logit_softcap
        if cap is not None:
            if (
                isinstance(cap, bool)
                or not isinstance(cap, numbers.Real)
                or not math.isfinite(float(cap))
                or float(cap) <= 0
            ):
                raise ValueError(
                    f"{_WHERE}: logit_softcap must be None or a positive finite "
                    f"Python number (it is static; do not pass a traced array), "
                    f"got {cap!r}."
                )
            object.__setattr__(self, "logit_softcap", float(cap))
        size = self.chunk_size
        if size is not None and (
            isinstance(size, bool) or not isinstance(size, numbers.Integral) or size <= 0
        ):
            raise ValueError(
                f"{_WHERE}: chunk_size must be None (default from config.py) or a "
                f"positive int number of tokens per chunk, got {size!r}."
            )
        OP.canonical(self.implementation)  # one-line error for an unknown name
        if self.weight_layout not in LAYOUTS:
            raise ValueError(
                f"{_WHERE}: weight_layout must be 'hv' (weight [H, V], an lm_head kernel) or 'vh' "
                f"(weight [V, H], a tied embedding table), got {self.weight_layout!r}."
            )


def _check_arrays(hidden, weight, targets, weights, layout: str) -> None:
    def fail(msg: str) -> None:
        raise ValueError(f"{_WHERE}: {msg}")

    shape_name = "[H, V]" if layout == "hv" else "[V, H]"

    if hidden.ndim != 2:
        fail(
            f"hidden must be [N, H], got shape {hidden.shape}; flatten batch and "
            f"sequence axes first (hidden.reshape(-1, H))."
        )
    if weight.ndim != 2:
        fail(f"weight must be {shape_name} (weight_layout={layout!r}), got {weight.shape}.")
    n, h = hidden.shape
    vocab = weight.shape[vocab_axis(layout)]
    if weight.shape[1 - vocab_axis(layout)] != h:
        hint = ("; pass an embedding table [V, H] as it is with weight_layout='vh'" if layout == "hv"
                else "; pass an lm_head kernel [H, V] with weight_layout='hv'")
        fail(f"weight {weight.shape} must be {shape_name} with H={h} from hidden {hidden.shape}{hint}.")
    if n == 0 or vocab == 0:
        fail(f"needs at least one token and one vocabulary entry, got N={n}, V={vocab}.")
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            fail(f"{name} must be floating point (bf16/fp32), got {x.dtype}.")
    if targets.shape != (n,) or not jnp.issubdtype(targets.dtype, jnp.integer):
        fail(
            f"targets must be an integer array of shape ({n},), got "
            f"{targets.dtype}{list(targets.shape)}."
        )
    if weights.shape != (n,) or not jnp.issubdtype(weights.dtype, jnp.floating):
        fail(
            f"weights must be a float array of shape ({n},) (0 = ignored token), "
            f"got {weights.dtype}{list(weights.shape)}; e.g. pass "
            f"loss_mask.reshape(-1).astype(jnp.float32)."
        )


def linear_cross_entropy(
    hidden: jax.Array,
    weight: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    *,
    logit_softcap: float | None = None,
    chunk_size: int | None = None,
    implementation: str | None = "xla",
    weight_layout: str = "hv",
) -> jax.Array:
    """Weighted sum of token cross-entropies of ``hidden @ weight``.

    Args:
      hidden: ``[N, H]`` bf16/fp32 hidden states (after the final norm).
      weight: ``[H, V]`` output projection (``lm_head.kernel``), or with
        ``weight_layout="vh"`` a ``[V, H]`` embedding table (tied head), read in
        place: passing ``embedding.T`` instead costs a materialised transposed
        copy of the table (the chunk loop keeps XLA from folding the transpose).
      targets: ``[N]`` integer target ids; values of ignored tokens are never
        used (they are clipped into range), so -100 padding is fine.
      weights: ``[N]`` float per-token weights; 0 ignores the token.  The loss
        is a plain weighted sum: divide by ``weights.sum()`` for a mean.
      logit_softcap: optional ``c``: logits become ``c * tanh(x / c)``.
      chunk_size: tokens per chunk (xla implementation).  ``None`` picks
        ``config.tiles_for(device_kind, N, V)``: one chunk's fp32 logits stay
        under the device's ``logits_chunk_bytes`` (256 MiB on an H200, 64 MiB
        elsewhere).
      implementation: ``"xla"`` (chunked, custom VJP; never holds ``[N, V]``),
        ``"reference"`` (naive full logits; for tests and benchmarks), or
        ``"auto"``/None (``"xla"``).
      weight_layout: ``"hv"`` (default) or ``"vh"``, see ``weight``; the weight
        gradient comes back in the same layout.

    Returns:
      fp32 scalar ``sum_i weights_i * CE_i``.  Differentiable w.r.t.
      ``hidden``, ``weight`` and ``weights``; gradients that are not requested
      are not computed (in particular no ``[H, V]`` work for a frozen head).
    """
    options = _Options(logit_softcap, chunk_size, implementation, weight_layout)
    hidden, weight = jnp.asarray(hidden), jnp.asarray(weight)
    targets, weights = jnp.asarray(targets), jnp.asarray(weights)
    _check_arrays(hidden, weight, targets, weights, options.weight_layout)
    targets = targets.astype(jnp.int32)
    impl = OP.resolve(options.implementation)
    return impl.fn(hidden, weight, targets, weights,
                   logit_softcap=options.logit_softcap, chunk_size=options.chunk_size,
                   weight_layout=options.weight_layout)
