"""experiments/kernels/nf4_triton.py (the 4-bit matmul's Pallas kernels, dequantising inside the K loop; not in
kernels_pallas.nf4_matmul's dispatch) in interpret mode against the op's reference: forward and input gradient,
fp32 and bf16, NF4 and FP4, leading dimensions, no dequantised weight kept for the backward, and a weight outside
the kernels' layout is a one-line error."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from experiments.kernels.nf4_triton import Nf4TileConfig, nf4_matmul_triton, supports
from jaxft.quant import quantize_4bit
from kernels_pallas import nf4_matmul as ops
from kernels_pallas.nf4_matmul.shapes import TEST_SHAPES, Nf4Shape, make_inputs

TOL = {"float32": 1e-6, "bfloat16": 2e-2}
# In the kernels' layout (whole blocks per row, rows in whole tiles of TILES' block_n = 32): odd row counts (padded
# to block_m), blocks of 32 / 64 / 128, several K-loop steps both ways.
SHAPES = (
    Nf4Shape("k_f32", 37, 64, 192, 64),
    Nf4Shape("k_bs32_bf16", 20, 96, 256, 32, "bfloat16"),
    Nf4Shape("k_bs128_f32", 33, 64, 256, 128),
)
TILES = {"block_m": 16, "block_n": 32}


def _operands(shape, quant_type="nf4"):
    x, w, dy = make_inputs(shape)
    q = quantize_4bit(w, quant_type=quant_type, blocksize=shape.blocksize, double_quant=False)
    return x, q, dy, (shape.out_features, shape.in_features)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _reference(q, dims, blocksize, quant_type="nf4"):
    return lambda a: ops.nf4_matmul(a, q.packed, q.absmax, shape=dims, blocksize=blocksize, quant_type=quant_type,
                                    implementation="reference")


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_kernels_forward_and_input_gradient_equal_reference(shape, quant_type):
    x, q, dy, dims = _operands(shape, quant_type)
    config = Nf4TileConfig(**TILES)

    def run(fn):
        y, pullback = jax.vjp(fn, x)
        return y, pullback(dy)[0]

    y_ref, dx_ref = run(_reference(q, dims, shape.blocksize, quant_type))
    y, dx = run(lambda a: nf4_matmul_triton(a, q.packed, q.absmax, shape=dims, blocksize=shape.blocksize,
                                            quant_type=quant_type, config=config))
    assert y.dtype == x.dtype and dx.dtype == x.dtype and y.shape == y_ref.shape and dx.shape == x.shape
    assert _rel(y, y_ref) <= TOL[shape.dtype] and _rel(dx, dx_ref) <= TOL[shape.dtype]


def test_leading_dims_and_no_weight_residual():
    shape = Nf4Shape("api", 9, 128, 128, 64)
    x, q, dy, dims = _operands(shape)
    x3, dy3 = x[:8].reshape(2, 4, 128), dy[:8].reshape(2, 4, 128)
    assert supports(dims, 64) and not supports((96, 128), 64)

    y, pullback = jax.vjp(lambda a: nf4_matmul_triton(a, q.packed, q.absmax, shape=dims, blocksize=64), x3)
    y_ref, pullback_ref = jax.vjp(_reference(q, dims, 64), x3)
    assert _rel(y, y_ref) <= 1e-6 and _rel(pullback(dy3)[0], pullback_ref(dy3)[0]) <= 1e-6
    kept = [tuple(leaf.shape) for leaf in jax.tree.leaves(pullback) if hasattr(leaf, "shape")]
    assert dims not in kept and dims[::-1] not in kept  # the backward rebuilds W's tiles from the bytes


def test_outside_its_layout_is_one_line_naming_the_fallback():
    shape = TEST_SHAPES[0]  # 96 weight rows: not whole tiles of 128
    x, q, _, dims = _operands(shape)
    with pytest.raises(ValueError, match="outside the kernel's layout.*implementation='xla'"):
        nf4_matmul_triton(x, q.packed, q.absmax, shape=dims, blocksize=shape.blocksize)
