"""RMSNorm (plain and Gemma's 1 + w), SwiGLU and GeGLU ops: values and gradients equal their references; the custom VJPs keep fewer bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
# `print_saved_residuals` is the public face of this; the list itself is only in jax._src (pinned JAX)
from jax._src.ad_checkpoint import saved_residuals

from kernels_pallas.glu import (clamped_swiglu, clamped_swiglu_reference, geglu_tanh, geglu_tanh_reference, swiglu,
                                swiglu_reference)
from kernels_pallas.rmsnorm import rmsnorm, rmsnorm_offset_reference, rmsnorm_reference
from kernel_helpers import jitted_vjp

NORMS = {False: rmsnorm_reference, True: rmsnorm_offset_reference}  # offset -> reference
GLUS = {"swiglu": (swiglu, swiglu_reference), "geglu_tanh": (geglu_tanh, geglu_tanh_reference)}

TOL = {jnp.float32: 2e-6, jnp.bfloat16: 2e-2}


def _close(got, want, dtype, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = max(1.0, float(np.max(np.abs(want))))
    assert float(np.max(np.abs(got - want))) <= TOL[dtype] * scale, what


def _rand(shape, dtype, seed, scale=1.0):
    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(dtype)


@pytest.mark.parametrize("shape,dtype,offset", [  # hidden states; per-head q/k norm: each pair once
    ((3, 37, 64), jnp.float32, False), ((3, 37, 64), jnp.bfloat16, True),
    ((2, 16, 4, 32), jnp.float32, True), ((2, 16, 4, 32), jnp.bfloat16, False)])
def test_rmsnorm_matches_reference(dtype, shape, offset):
    # Gemma's stored weights sit near 0 (the scale is 1 + w): draw them there, far from exactly 0.
    w = _rand(shape[-1:], dtype, 1, 0.3) + (0.0 if offset else 1.0)
    x, dy = _rand(shape, dtype, 0, 3.0), _rand(shape, dtype, 2)
    got = jitted_vjp(lambda x, w: rmsnorm(x, w, 1e-6, offset=offset), dy, x, w)
    want = jitted_vjp(lambda x, w: NORMS[offset](x, w, 1e-6), dy, x, w)
    _close(got[0], want[0], dtype, "y")
    for name, g, r in zip(("dx", "dw"), got[1:], want[1:]):
        assert g.dtype == r.dtype
        _close(g, r, dtype, name)


@pytest.mark.parametrize("op", list(GLUS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_glu_matches_reference(dtype, op):
    fn, reference = GLUS[op]
    g, u, dh = _rand((4, 33, 96), dtype, 3, 3.0), _rand((4, 33, 96), dtype, 4), _rand((4, 33, 96), dtype, 5)
    got, want = jitted_vjp(fn, dh, g, u), jitted_vjp(reference, dh, g, u)
    _close(got[0], want[0], dtype, "h")
    for name, a, b in zip(("dgate", "dup"), got[1:], want[1:]):
        _close(a, b, dtype, name)


def _residual_bytes(fn, *args):
    return sum(int(np.prod(aval.shape)) * aval.dtype.itemsize for aval, _ in saved_residuals(fn, *args))


@pytest.mark.parametrize("offset", [False, True])
def test_rmsnorm_custom_vjp_saves_less_than_autodiff(offset):
    x, w = _rand((8, 128, 256), jnp.bfloat16, 0), _rand((256,), jnp.bfloat16, 1)
    x_bytes = x.size * 2
    ours = _residual_bytes(lambda x, w: rmsnorm(x, w, 1e-6, offset=offset).astype(jnp.float32).sum(), x, w)
    ref = _residual_bytes(lambda x, w: NORMS[offset](x, w, 1e-6).astype(jnp.float32).sum(), x, w)
    # x itself plus one fp32 scalar per row (and w) -- no fp32 copy of x.
    assert ours <= x_bytes + 8 * 128 * 4 + 256 * 2 < ref


@pytest.mark.parametrize("op", list(GLUS))
def test_glu_custom_vjp_saves_less_than_autodiff(op):
    fn, reference = GLUS[op]
    g, u = _rand((8, 128, 512), jnp.bfloat16, 2), _rand((8, 128, 512), jnp.bfloat16, 3)
    ours = _residual_bytes(lambda g, u: fn(g, u).astype(jnp.float32).sum(), g, u)
    ref = _residual_bytes(lambda g, u: reference(g, u).astype(jnp.float32).sum(), g, u)
    assert ours == g.size * 2 * 2 < ref  # gate and up only


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="rmsnorm/api.py: weight shape"):
        rmsnorm(jnp.ones((2, 8)), jnp.ones((4,)), 1e-6)
    with pytest.raises(ValueError, match="glu/api.py"):
        swiglu(jnp.ones((2, 8)), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="glu/api.py"):
        geglu_tanh(jnp.ones((2, 8)), jnp.ones((2, 8), jnp.bfloat16))
    with pytest.raises(ValueError, match="glu/api.py: clamped_swiglu takes interleaved gate/up columns"):
        clamped_swiglu(jnp.ones((2, 7)), LIMIT, ALPHA)
    with pytest.raises(ValueError, match="implementation"):
        rmsnorm(jnp.ones((2, 8)), jnp.ones((8,)), 1e-6, implementation="triton")


LIMIT, ALPHA = 7.0, 1.702  # GPT-OSS's


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_clamped_swiglu_matches_its_definition_off_the_bounds(dtype):
    """Values of a few limits' size, so both clamps cut some; compared where no input sits on a bound, since there
    autodiff of the definition halves the gradient (next test)."""
    x, dh = _rand((4, 33, 192), dtype, 6, 6.0), _rand((4, 33, 96), dtype, 7)
    got, g = jitted_vjp(lambda x: clamped_swiglu(x, LIMIT, ALPHA), dh, x)
    want, r = jitted_vjp(lambda x: clamped_swiglu_reference(x, LIMIT, ALPHA), dh, x)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))  # the same forward
    xf = np.asarray(x, np.float32)
    cut = (xf[..., 0::2] > LIMIT).mean(), (np.abs(xf[..., 1::2]) > LIMIT).mean()
    assert all(0.05 < c < 0.5 for c in cut), cut
    off = np.abs(np.abs(xf) - LIMIT) > 0
    assert g.dtype == x.dtype
    _close(np.where(off, np.asarray(g, np.float32), 0), np.where(off, np.asarray(r, np.float32), 0), dtype, "dx")


def test_clamped_swiglu_gradient_is_torchs_on_and_off_the_bounds():
    """transformers' GptOssExperts' activation under torch autograd (the oracle), fp32, with inputs set exactly on
    the bounds: torch's clamp passes no gradient there, and neither does ours (autodiff of the definition: half)."""
    import torch

    x = np.array(_rand((3, 17, 64), jnp.float32, 8, 6.0))
    x[0, :4, 0::2] = LIMIT  # gates on the bound
    x[1, :4, 1::2] = -LIMIT  # ups on both bounds
    x[2, :4, 1::2] = LIMIT
    dh = np.asarray(_rand((3, 17, 32), jnp.float32, 9))
    t = torch.tensor(x, requires_grad=True)
    gate = t[..., ::2].clamp(min=None, max=LIMIT)
    up = t[..., 1::2].clamp(min=-LIMIT, max=LIMIT)
    h = (up + 1) * (gate * torch.sigmoid(gate * ALPHA))
    h.backward(torch.tensor(dh))
    got, vjp = jax.vjp(lambda x: clamped_swiglu(x, LIMIT, ALPHA), jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), h.detach().numpy(), rtol=1e-6, atol=1e-6)
    (g,) = vjp(jnp.asarray(dh))
    np.testing.assert_allclose(np.asarray(g), t.grad.numpy(), rtol=1e-5, atol=1e-5)
    assert not np.any(t.grad.numpy()[0, :4, 0::2]) and not np.any(t.grad.numpy()[1:, :4, 1::2])  # none on a bound
    assert np.count_nonzero(np.asarray(g)) > g.size // 2


def test_clamped_swiglu_saves_the_product_only():
    x = _rand((8, 128, 1024), jnp.bfloat16, 10, 6.0)
    ours = _residual_bytes(lambda x: clamped_swiglu(x, LIMIT, ALPHA).astype(jnp.float32).sum(), x)
    ref = _residual_bytes(lambda x: clamped_swiglu_reference(x, LIMIT, ALPHA).astype(jnp.float32).sum(), x)
    assert ours == x.size * 2 and 3 * ours < ref  # autodiff keeps several times as much
