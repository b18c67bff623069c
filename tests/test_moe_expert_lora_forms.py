"""`ExpertLora`'s token-side forms against its grouped definition `delta`: `sorted_factors` (the gate/up adapter's A
on the N tokens, its product taken by the grouped matmul) and `combined_delta` (the down adapter's B inside the weighted combine) give the same values and the
same gradients in x, the routing weights, A and B, for fp32 (ragged_dot) and bf16 (the Mosaic kernels' interpreter),
with empty experts; and the compiled down adapter writes no [N*k, out] product."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxft.models.moe import ExpertLora, combine, dispatch, gather_tokens
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


CASES = [(jnp.float32, "xla", 1e-5), (jnp.bfloat16, "pallas_mosaic", 3e-2)]


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
def test_combined_delta_equals_the_grouped_definition_inside_the_combine(dtype, impl, tol):
    experts, weights, xf, a, b, dy = _setup(2, dtype)
    w_in = jnp.asarray(np.random.default_rng(3).standard_normal((H, H)) / H ** 0.5, dtype)

    def loss(form, xf, weights, a, b):
        r = dispatch(experts, E)
        h = jnp.tanh(gather_tokens(xf, r.token, r.inverse, K) @ w_in).astype(dtype)  # stand-in expert rows
        base = jnp.zeros((N * K, O), dtype)
        lora = _adapter(a, b)
        if form == "tokens":
            out = combine(base, weights, r, jnp.zeros((N, O), dtype),
                          lora.combined_delta(h, weights, experts, r, impl))
        else:
            out = combine(base + lora.delta(h, r.group_sizes, impl), weights, r, jnp.zeros((N, O), dtype))
        return jnp.sum(out.astype(jnp.float32) * dy), out

    args = (xf, weights, a, b)
    (_, got), g_got = jax.value_and_grad(lambda *p: loss("tokens", *p), argnums=(0, 1, 2, 3), has_aux=True)(*args)
    (_, want), g_want = jax.value_and_grad(lambda *p: loss("grouped", *p), argnums=(0, 1, 2, 3), has_aux=True)(*args)
    assert _err(got, want) < tol
    for name, gg, gw in zip(("x", "weights", "A", "B"), g_got, g_want):
        assert _err(gg, gw) < tol, name


def test_the_compiled_down_adapter_writes_no_sorted_row_product():
    """The B side of `combined_delta` is a [N, E r] x [E r, out] product: the compiled gradient holds no
    [N*k, out] value (the grouped form's B output, which the combine then read back)."""
    experts, weights, xf, a, b, dy = _setup(4, jnp.float32)

    def loss(h, a, b):
        r = dispatch(experts, E)
        return jnp.sum(_adapter(a, b).combined_delta(h, weights, experts, r, "xla") * dy)

    h = jnp.asarray(np.random.default_rng(5).standard_normal((N * K, H)), jnp.float32)
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(h, a, b).compile().as_text()
    assert f"f32[{N},{O}]" in hlo  # the token-side product is there
    assert f"f32[{N * K},{O}]" not in hlo
