"""Grouped matmul (kernels_pallas/grouped_matmul): every implementation against a dense per-group loop.

The oracle here is independent of the op's code: numpy in float64, one plain matmul per group over that
group's rows (lhs_g @ rhs[g]; d lhs_g = dout_g rhs[g]^T; d rhs[g] = lhs_g^T dout_g), zeros for rows past the
last group and for empty groups' rhs gradients. Shapes (shapes.TEST_SHAPES) have empty groups first, in the
middle and last, and rows left over.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.grouped_matmul import OP, grouped_matmul
from kernels_pallas.grouped_matmul.shapes import TEST_SHAPES, make_inputs

TOL = {"float32": 2e-5, "bfloat16": 3e-2}


def _loop(lhs, rhs, sizes, dout):
    lhs, rhs, dout = (np.asarray(a, np.float64) for a in (lhs, rhs, dout))
    out, dlhs, drhs = np.zeros((lhs.shape[0], rhs.shape[2])), np.zeros_like(lhs), np.zeros_like(rhs)
    start = 0
    for g, size in enumerate(np.asarray(sizes)):
        rows = slice(start, start + int(size))
        out[rows] = lhs[rows] @ rhs[g]
        dlhs[rows] = dout[rows] @ rhs[g].T
        drhs[g] = lhs[rows].T @ dout[rows]
        start += int(size)
    return out, dlhs, drhs


def _close(got, want, dtype, what):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    scale = max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    assert err <= TOL[dtype] * scale, f"{what}: max |err| {err:.3g} > {TOL[dtype]} * {scale:.3g}"


@pytest.mark.parametrize("impl", OP.names)
@pytest.mark.parametrize("shape", TEST_SHAPES, ids=[s.name for s in TEST_SHAPES])
def test_forward_and_gradients_match_a_per_group_loop(impl, shape):
    lhs, rhs, sizes, dout = make_inputs(shape)
    out, vjp = jax.vjp(lambda l, r: grouped_matmul(l, r, sizes, implementation=impl), lhs, rhs)
    dlhs, drhs = vjp(dout)
    want_out, want_dlhs, want_drhs = _loop(lhs, rhs, sizes, dout)
    assert out.shape == want_out.shape and out.dtype == lhs.dtype
    _close(out, want_out, shape.dtype, "out")
    _close(dlhs, want_dlhs, shape.dtype, "d lhs")
    _close(drhs, want_drhs, shape.dtype, "d rhs")
    # Empty groups get exactly zero rhs gradient, rows past the last group exactly zero output and d lhs.
    empty = np.asarray(sizes) == 0
    assert not np.any(np.asarray(drhs, np.float32)[empty])
    used = int(np.sum(np.asarray(sizes)))
    assert not np.any(np.asarray(out, np.float32)[used:]) and not np.any(np.asarray(dlhs, np.float32)[used:])


@pytest.mark.parametrize("impl", OP.names)
def test_group_sizes_are_traced_one_program_serves_every_split(impl):
    shape = TEST_SHAPES[0]
    lhs, rhs, _, dout = make_inputs(shape)
    fn = jax.jit(lambda l, r, s: grouped_matmul(l, r, s, implementation=impl))
    for sizes in ((15, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 15), (2, 3, 0, 4, 1, 5)):
        s = jnp.asarray(sizes, jnp.int32)
        _close(fn(lhs, rhs, s), _loop(lhs, rhs, s, dout)[0], shape.dtype, f"out for sizes {sizes}")
    assert fn._cache_size() == 1


def test_bad_shapes_are_one_line_naming_the_file():
    lhs, rhs, sizes, _ = make_inputs(TEST_SHAPES[0])
    with pytest.raises(ValueError, match=r"grouped_matmul/api.py: .*lhs \[M, K\] and rhs \[G, K, N\]"):
        grouped_matmul(lhs[:, :-1], rhs, sizes)
    with pytest.raises(ValueError, match=r"group_sizes must be integers of shape \(6,\)"):
        grouped_matmul(lhs, rhs, sizes[:-1])
    with pytest.raises(ValueError, match=r"same dtype"):
        grouped_matmul(lhs.astype(jnp.bfloat16), rhs, sizes)
    with pytest.raises(ValueError, match=r"grouped_matmul has no implementation='triton'"):
        grouped_matmul(lhs, rhs, sizes, implementation="triton")
