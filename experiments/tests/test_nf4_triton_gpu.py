"""The 4-bit matmul's Pallas kernels (experiments/kernels/nf4_triton.py) on the GPU: bf16 forward and input
gradient against the dequantise-then-matmul "xla" implementation on a weight of 8B-like proportions with a row
count that is no multiple of the tile, and both kernels by name in the compiled program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxft.quant import quantize_4bit
from kernels_pallas import nf4_matmul as ops
from kernels_pallas.nf4_matmul.shapes import Nf4Shape, make_inputs
from experiments.kernels.nf4_triton import DX_NAME, FWD_NAME, nf4_matmul_triton

NO_AUTOTUNE = {"xla_gpu_autotune_level": 0}  # the GEMM algorithm, not the math (tests/gpu_helpers.py says why)

pytestmark = pytest.mark.gpu


def test_triton_kernels_match_xla_in_bf16_and_are_in_the_compiled_program():
    shape = Nf4Shape("gpu", 1000, 1024, 2048, 64, "bfloat16")
    x, w, dy = make_inputs(shape)
    q = quantize_4bit(w, blocksize=64, double_quant=False)
    dims = (shape.out_features, shape.in_features)

    def step(matmul):
        def run(a, packed, absmax, cot):
            y, pullback = jax.vjp(lambda b: matmul(b, packed, absmax, shape=dims, blocksize=64), a)
            return y, pullback(cot)[0]
        return jax.jit(run).lower(x, q.packed, q.absmax, dy).compile(compiler_options=NO_AUTOTUNE)

    kernels = step(nf4_matmul_triton)
    xla = step(lambda b, p, m, **kw: ops.nf4_matmul(b, p, m, implementation="xla", **kw))
    hlo = kernels.as_text()
    assert FWD_NAME in hlo and DX_NAME in hlo
    (y, dx), (y_want, dx_want) = kernels(x, q.packed, q.absmax, dy), xla(x, q.packed, q.absmax, dy)
    assert y.dtype == dx.dtype == jnp.bfloat16 and y.shape == y_want.shape and dx.shape == x.shape
    for got, want in ((y, y_want), (dx, dx_want)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.max(np.abs(got - want)) <= 2e-2 * np.max(np.abs(want))
