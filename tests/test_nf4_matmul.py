"""kernels_pallas/nf4_matmul: the "xla" implementation (re-dequantising custom VJP) and the Pallas kernels
("triton", interpret mode here) against the reference (autodiff of dequantise-then-matmul) on random inputs,
forward and input gradient, fp32 and bf16, NF4 and FP4; their backwards keep no dequantised weight from the
forward; bad inputs are one-line errors."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxft.quant import quantize_4bit
from kernels_pallas import nf4_matmul as ops
from kernels_pallas.nf4_matmul.shapes import KERNEL_TEST_SHAPES, KERNEL_TEST_TILES, TEST_SHAPES, Nf4Shape, make_inputs

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
    with pytest.raises(ValueError, match="no implementation='pallas'"):
        ops.nf4_matmul(x, q.packed, q.absmax, shape=dims, blocksize=shape.blocksize, implementation="pallas")


# ------------------------------------------------------------------------------ the Pallas kernels (interpret mode)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("shape", KERNEL_TEST_SHAPES, ids=lambda s: s.name)
def test_triton_kernels_forward_and_input_gradient_equal_reference(shape, quant_type):
    from kernels_pallas.nf4_matmul.triton import Nf4TileConfig, nf4_matmul_triton

    x, q, dy, dims = _operands(shape, quant_type)
    config = Nf4TileConfig(**KERNEL_TEST_TILES)

    def run(fn):
        y, pullback = jax.vjp(fn, x)
        return y, pullback(dy)[0]

    y_ref, dx_ref = run(lambda a: ops.nf4_matmul(a, q.packed, q.absmax, shape=dims, blocksize=shape.blocksize,
                                                 quant_type=quant_type, implementation="reference"))
    y, dx = run(lambda a: nf4_matmul_triton(a, q.packed, q.absmax, shape=dims, blocksize=shape.blocksize,
                                            quant_type=quant_type, config=config))
    assert y.dtype == x.dtype and dx.dtype == x.dtype and y.shape == y_ref.shape and dx.shape == x.shape
    assert _rel(y, y_ref) <= TOL[shape.dtype] and _rel(dx, dx_ref) <= TOL[shape.dtype]


def test_triton_through_the_api_with_leading_dims_and_no_weight_residual():
    shape = Nf4Shape("api", 9, 128, 128, 64)
    x, q, dy, dims = _operands(shape)
    x3, dy3 = x[:8].reshape(2, 4, 128), dy[:8].reshape(2, 4, 128)
    assert ops.supports("triton", dims, 64) and not ops.supports("triton", (96, 128), 64)

    def f(impl):
        return lambda a: ops.nf4_matmul(a, q.packed, q.absmax, shape=dims, blocksize=64, implementation=impl)

    y, pullback = jax.vjp(f("triton"), x3)
    y_ref, pullback_ref = jax.vjp(f("reference"), x3)
    assert _rel(y, y_ref) <= 1e-6 and _rel(pullback(dy3)[0], pullback_ref(dy3)[0]) <= 1e-6
    kept = [tuple(leaf.shape) for leaf in jax.tree.leaves(pullback) if hasattr(leaf, "shape")]
    assert dims not in kept and dims[::-1] not in kept  # the backward rebuilds W's tiles from the bytes
    assert ops.OP.default_for("cpu") == "xla"


def test_triton_outside_its_layout_is_one_line_naming_the_fallback():
    shape = TEST_SHAPES[0]  # 96 weight rows: not whole tiles of 128
    x, q, _, dims = _operands(shape)
    with pytest.raises(ValueError, match="outside the kernel's layout.*implementation='xla'"):
        ops.nf4_matmul(x, q.packed, q.absmax, shape=dims, blocksize=shape.blocksize, implementation="triton")
