"""`ExpertLora`'s factor forms against its grouped definition `delta`: `sorted_factors` (the gate/up adapter's A on
the N tokens, its product taken by the grouped matmul) and `grouped_adapter` (the down adapter's, one op with the
experts' grouped matmul) give the same values and the same gradients in x, A and B, for fp32 and bf16, with empty
experts. ExpertLora has no code of its own per grouped matmul implementation: the forms run on ragged_dot; the Mosaic
kernels with `lora=` / `adapter=` against the definition are tests/test_grouped_matmul.py's
(test_a_fused_adapter_adds_its_product_and_gets_its_gradients, test_an_adapter_on_the_products_own_rows_...)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxft.models.moe import ExpertLora, dispatch, gather_tokens
from kernels_pallas.grouped_matmul import grouped_matmul

N, K, H, O, E, R = 80, 4, 32, 48, 8, 8


def _setup(seed: int, dtype):
    rng = np.random.default_rng(seed)
    # Experts 6 and 7 get no rows: empty groups.
    experts = np.stack([rng.choice(E - 2, K, replace=False) for _ in range(N)]).astype(np.int32)
    weights = rng.random((N, K)).astype(np.float32)
    weights = jnp.asarray(weights / weights.sum(-1, keepdims=True), dtype)
    xf = jnp.asarray(rng.standard_normal((N, H)), dtype)
    # B is perturbed away from PEFT's zero start, or the comparison would prove nothing about it.
    a = jnp.asarray(rng.standard_normal((E, H, R)) / H ** 0.5, jnp.float32)
    b = jnp.asarray(rng.standard_normal((E, R, O)) / R ** 0.5, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((N, O)), jnp.float32)
    return jnp.asarray(experts), weights, xf, a, b, dy


def _adapter(a, b):
    return ExpertLora(a, b, jnp.asarray(0.5, jnp.float32), jnp.asarray(R, jnp.int32))


CASES = [(jnp.float32, "xla", 1e-5), (jnp.bfloat16, "xla", 3e-2)]


def _err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("dtype,impl,tol", CASES)
def test_sorted_factors_product_equals_the_grouped_definition(dtype, impl, tol):
    experts, _, xf, a, b, _ = _setup(0, dtype)
    dy = jnp.asarray(np.random.default_rng(1).standard_normal((N * K, O)), jnp.float32)

    def loss(form, xf, a, b):
        r = dispatch(experts, E)
        lora = _adapter(a, b)
        if form == "tokens":
            out = grouped_matmul(*lora.sorted_factors(xf, experts, r), r.group_sizes, implementation=impl)
        else:
            out = lora.delta(gather_tokens(xf, r.token, r.inverse, K), r.group_sizes, impl)
        return jnp.sum(out.astype(jnp.float32) * dy), out

    (_, got), g_got = jax.value_and_grad(lambda *p: loss("tokens", *p), argnums=(0, 1, 2), has_aux=True)(xf, a, b)
    (_, want), g_want = jax.value_and_grad(lambda *p: loss("grouped", *p), argnums=(0, 1, 2), has_aux=True)(xf, a, b)
    assert _err(got, want) < tol
    for name, gg, gw in zip(("x", "A", "B"), g_got, g_want):
        assert _err(gg, gw) < tol, name


@pytest.mark.parametrize("dtype,impl,tol", CASES)
def test_grouped_adapter_fused_into_the_experts_matmul_equals_the_weight_plus_the_definition(dtype, impl, tol):
    """The down adapter as the blocks run it: the experts' grouped matmul of h with its `adapter` =
    `grouped_adapter` (one custom VJP on the Mosaic kernels) against gmm(h, W) + delta(h), in value and in the
    gradients of h (through W and A both), A and B."""
    experts, _, xf, a, b, _ = _setup(2, dtype)
    rng = np.random.default_rng(3)
    w_in = jnp.asarray(rng.standard_normal((H, H)) / H ** 0.5, dtype)
    w_down = jnp.asarray(rng.standard_normal((E, H, O)) / H ** 0.5, dtype)
    dy = jnp.asarray(rng.standard_normal((N * K, O)), jnp.float32)

    def loss(form, xf, a, b):
        r = dispatch(experts, E)
        h = jnp.tanh(gather_tokens(xf, r.token, r.inverse, K) @ w_in).astype(dtype)  # stand-in expert rows
        lora = _adapter(a, b)
        if form == "fused":
            out = grouped_matmul(h, w_down, r.group_sizes, implementation=impl,
                                 adapter=lora.grouped_adapter(dtype))
        else:
            base = grouped_matmul(h, w_down, r.group_sizes, implementation=impl)
            out = (base.astype(jnp.float32) + lora.delta(h, r.group_sizes, impl).astype(jnp.float32)).astype(dtype)
        return jnp.sum(out.astype(jnp.float32) * dy), out

    (_, got), g_got = jax.value_and_grad(lambda *p: loss("fused", *p), argnums=(0, 1, 2), has_aux=True)(xf, a, b)
    (_, want), g_want = jax.value_and_grad(lambda *p: loss("two", *p), argnums=(0, 1, 2), has_aux=True)(xf, a, b)
    assert _err(got, want) < tol
    for name, gg, gw in zip(("x", "A", "B"), g_got, g_want):
        assert _err(gg, gw) < tol, name
        assert float(jnp.max(jnp.abs(gw))) > 0  # a real gradient
