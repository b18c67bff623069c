"""RMSNorm (plain and Gemma's 1 + w), SwiGLU and GeGLU ops: values and gradients equal their references; the custom VJPs keep fewer bytes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
# `print_saved_residuals` is the public face of this; the list itself is only in jax._src (pinned JAX)
from jax._src.ad_checkpoint import saved_residuals

from kernels_pallas.glu import geglu_tanh, geglu_tanh_reference, swiglu, swiglu_reference
from kernels_pallas.rmsnorm import rmsnorm, rmsnorm_offset_reference, rmsnorm_reference

NORMS = {False: rmsnorm_reference, True: rmsnorm_offset_reference}  # offset -> reference
GLUS = {"swiglu": (swiglu, swiglu_reference), "geglu_tanh": (geglu_tanh, geglu_tanh_reference)}

TOL = {jnp.float32: 2e-6, jnp.bfloat16: 2e-2}


def _close(got, want, dtype, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = max(1.0, float(np.max(np.abs(want))))
    assert float(np.max(np.abs(got - want))) <= TOL[dtype] * scale, what


def _rand(shape, dtype, seed, scale=1.0):
    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(dtype)


@pytest.mark.parametrize("offset", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(3, 37, 64), (2, 16, 4, 32)])  # hidden states; per-head q/k norm
def test_rmsnorm_matches_reference(dtype, shape, offset):
    # Gemma's stored weights sit near 0 (the scale is 1 + w): draw them there, far from exactly 0.
    w = _rand(shape[-1:], dtype, 1, 0.3) + (0.0 if offset else 1.0)
    x, dy = _rand(shape, dtype, 0, 3.0), _rand(shape, dtype, 2)
    got, got_vjp = jax.vjp(lambda x, w: rmsnorm(x, w, 1e-6, offset=offset), x, w)
    want, want_vjp = jax.vjp(lambda x, w: NORMS[offset](x, w, 1e-6), x, w)
    _close(got, want, dtype, "y")
    for name, g, r in zip(("dx", "dw"), got_vjp(dy), want_vjp(dy)):
        assert g.dtype == r.dtype
        _close(g, r, dtype, name)


@pytest.mark.parametrize("op", list(GLUS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_glu_matches_reference(dtype, op):
    fn, reference = GLUS[op]
    g, u, dh = _rand((4, 33, 96), dtype, 3, 3.0), _rand((4, 33, 96), dtype, 4), _rand((4, 33, 96), dtype, 5)
    got, got_vjp = jax.vjp(fn, g, u)
    want, want_vjp = jax.vjp(reference, g, u)
    _close(got, want, dtype, "h")
    for name, a, b in zip(("dgate", "dup"), got_vjp(dh), want_vjp(dh)):
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
    with pytest.raises(ValueError, match="implementation"):
        rmsnorm(jnp.ones((2, 8)), jnp.ones((8,)), 1e-6, implementation="triton")
