"""kernels_pallas/nf4_matmul: the "xla" implementation (re-dequantising custom VJP) against the reference (autodiff
of dequantise-then-matmul) on random inputs, forward and input gradient, fp32 and bf16, NF4 and FP4; its backward
keeps no dequantised weight from the forward; bad inputs are one-line errors."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxft.quant import quantize_4bit
from kernels_pallas import nf4_matmul as ops
from kernels_pallas.nf4_matmul.shapes import TEST_SHAPES, make_inputs

TOL = {"float32": 1e-6, "bfloat16": 2e-2}


def _operands(shape, quant_type="nf4"):
    x, w, dy = make_inputs(shape)
    q = quantize_4bit(w, quant_type=quant_type, blocksize=shape.blocksize, double_quant=False)
    return x, q, dy, (shape.out_features, shape.in_features)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("shape", TEST_SHAPES, ids=lambda s: s.name)
def test_xla_forward_and_input_gradient_equal_reference(shape, quant_type):
    x, q, dy, dims = _operands(shape, quant_type)

    def run(impl):
        f = lambda a: ops.nf4_matmul(a, q.packed, q.absmax, shape=dims, blocksize=shape.blocksize,  # noqa: E731
                                     quant_type=quant_type, implementation=impl)
        y, pullback = jax.vjp(f, x)
        return y, pullback(dy)[0]

    y_ref, dx_ref = run("reference")
    y, dx = run("xla")
    assert y.dtype == x.dtype and dx.dtype == x.dtype
    assert _rel(y, y_ref) <= TOL[shape.dtype] and _rel(dx, dx_ref) <= TOL[shape.dtype]
    # Both equal x W^T / dy W with W dequantised independently here, in float32.
    w = ops.dequantize_4bit(q.packed, q.absmax, shape=dims, blocksize=shape.blocksize, quant_type=quant_type,
                            dtype=jnp.float32)
    x32, dy32 = x.astype(jnp.float32), dy.astype(jnp.float32)
    assert _rel(y, x32 @ w.T) <= TOL[shape.dtype] and _rel(dx, dy32 @ w) <= TOL[shape.dtype]


def test_backward_keeps_no_dequantised_weight():
    shape = TEST_SHAPES[0]
    x, q, _, dims = _operands(shape)

    def residual_shapes(impl):
        f = lambda a: ops.nf4_matmul(a, q.packed, q.absmax, shape=dims, blocksize=shape.blocksize,  # noqa: E731
                                     implementation=impl)
        _, pullback = jax.vjp(f, x)
        return [tuple(leaf.shape) for leaf in jax.tree.leaves(pullback) if hasattr(leaf, "shape")]

    assert dims in residual_shapes("reference") or dims[::-1] in residual_shapes("reference")  # autodiff keeps W
    kept = residual_shapes("xla")
    assert dims not in kept and dims[::-1] not in kept


def test_bad_inputs_are_one_line_errors():
    shape = TEST_SHAPES[0]
    x, q, _, dims = _operands(shape)
    with pytest.raises(ValueError, match="does not end in in_features"):
        ops.nf4_matmul(x[:, :-1], q.packed, q.absmax, shape=dims, blocksize=shape.blocksize)
    with pytest.raises(ValueError, match="absmax has"):
        ops.nf4_matmul(x, q.packed, q.absmax[:-1], shape=dims, blocksize=shape.blocksize)
    for name in ("pallas", "triton"):  # no kernel dequantises inside the matmul: "xla" is the fast path everywhere
        with pytest.raises(ValueError, match=f"no implementation='{name}'"):
            ops.nf4_matmul(x, q.packed, q.absmax, shape=dims, blocksize=shape.blocksize, implementation=name)
    assert ops.OP.names == ("reference", "xla") and ops.OP.default_for("gpu") == "xla"
