"""jaxft.models.moe's routing: the gathers that move rows to and from the expert-sorted order, forward and
gradient, against the plain definitions (a gather and a scatter-add, as autodiff would write them), and the
compiled backward scatters no activation rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxft.models.moe import combine, dispatch, gather_tokens

N, K, H, E = 96, 4, 24, 8


def _routing(seed: int, empty: bool = False):
    rng = np.random.default_rng(seed)
    experts = np.stack([rng.choice(E - 2 if empty else E, K, replace=False) for _ in range(N)]).astype(np.int32)
    weights = rng.random((N, K)).astype(np.float32)
    return jnp.asarray(experts), jnp.asarray(weights / weights.sum(-1, keepdims=True))


def _plain(xf, weights, experts, w_ys):
    """The definitions: sorted copy xf[order // k], expert rows ys = f(xs), scatter-add of w * ys."""
    order = jnp.argsort(experts.reshape(-1), stable=True)
    xs = xf[order // K]
    ys = w_ys(xs)
    ys = ys * weights.reshape(-1)[order][:, None]
    return jnp.zeros(xf.shape, jnp.float32).at[order // K].add(ys)


@pytest.mark.parametrize("empty", [False, True])
def test_dispatch_inverse_and_group_sizes(empty):
    experts, _ = _routing(0, empty)
    r = dispatch(experts, E)
    flat = np.asarray(experts).reshape(-1)
    np.testing.assert_array_equal(np.asarray(r.order), np.argsort(flat, kind="stable"))
    np.testing.assert_array_equal(np.asarray(r.order)[np.asarray(r.inverse)], np.arange(N * K))
    np.testing.assert_array_equal(np.asarray(r.token), np.asarray(r.order) // K)
    np.testing.assert_array_equal(np.asarray(r.group_sizes), np.bincount(flat, minlength=E))
    if empty:
        assert np.asarray(r.group_sizes)[-2:].tolist() == [0, 0]


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
def test_gather_and_combine_match_the_scatter_definition_forward_and_gradient(dtype, tol):
    experts, weights = _routing(1)
    rng = np.random.default_rng(2)
    xf = jnp.asarray(rng.standard_normal((N, H)), dtype)
    w = jnp.asarray(rng.standard_normal((H, H)) / H ** 0.5, dtype)
    dy = jnp.asarray(rng.standard_normal((N, H)), jnp.float32)
    expert_fn = lambda xs: jnp.tanh(xs @ w).astype(jnp.float32)  # noqa: E731 - a row-wise stand-in for the experts

    def ours(xf, weights):
        r = dispatch(experts, E)
        xs = gather_tokens(xf, r.token, r.inverse, K)
        return combine(expert_fn(xs).astype(dtype), weights, r, xf).astype(jnp.float32)

    def plain(xf, weights):
        return _plain(xf, weights, experts, lambda xs: expert_fn(xs).astype(dtype).astype(jnp.float32))

    out, vjp = jax.vjp(ours, xf, weights)
    ref, vjp_ref = jax.vjp(plain, xf, weights)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=tol, rtol=tol)
    for got, want in zip(vjp(dy.astype(out.dtype)), vjp_ref(dy)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=4 * tol,
                                   rtol=4 * tol)
        assert float(jnp.max(jnp.abs(want))) > 0.1  # a real gradient, not a vacuous zero


def test_the_backward_scatters_no_activation_rows():
    """Gathers both ways: the only scatters left in the compiled gradient are the int32 inverse permutation
    (N*k indices), none of [rows, H] activations."""
    experts, weights = _routing(3)
    xf = jnp.ones((N, H), jnp.float32)

    def loss(xf, weights):
        r = dispatch(experts, E)
        xs = gather_tokens(xf, r.token, r.inverse, K)
        return jnp.sum(combine(jnp.sin(xs), weights, r, xf) ** 2)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(xf, weights).as_text()
    scatters = [line for line in hlo.splitlines() if "stablehlo.scatter" in line or " scatter(" in line]
    assert scatters, "the inverse permutation is one scatter"
    assert all("x24x" not in line and f"{N * K}x{H}" not in line for line in scatters), scatters
    shapes = [line.split("->")[-1] for line in scatters]
    assert all("f32" not in s and "bf16" not in s for s in shapes), scatters
