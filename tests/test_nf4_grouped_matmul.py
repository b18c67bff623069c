"""kernels_pallas/nf4_matmul/grouped.py: the grouped matmul on per-group 4-bit weights. The "xla" implementation
(re-dequantising custom VJP) against the reference (autodiff of dequantise-then-grouped-matmul) and against a
float32 per-group product, forward and lhs gradient, ragged groups with an empty one, fp32 and bf16; its backward
keeps no dequantised weight, and in a layer scan the compiled program's temp memory stays below one copy of the
dequantised weights while the reference's holds them all; bad inputs are one-line errors."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxft.quant.blockwise import dequantize_absmax, quantize_4bit_batch
from kernels_pallas import nf4_matmul as ops

G, K, N, BLOCK = 4, 64, 48, 64  # groups, in, out (each group's weight is [N, K] in torch's layout)
SIZES = np.array([5, 0, 9, 6], np.int32)  # ragged, one empty group, 20 rows
TOL = {"float32": 1e-6, "bfloat16": 2e-2}


def _operands(dtype, seed=0):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((G, N, K)).astype(np.float32) * 0.05)
    q = quantize_4bit_batch(w, blocksize=BLOCK, double_quant=True)
    absmax = jax.vmap(dequantize_absmax)(q["absmax"], q["nested_absmax"], q["offset"])
    x = jnp.asarray(rng.standard_normal((int(SIZES.sum()), K)).astype(np.float32)).astype(dtype)
    dy = jnp.asarray(rng.standard_normal((int(SIZES.sum()), N)).astype(np.float32)).astype(dtype)
    return x, q["packed"], absmax, dy


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_xla_forward_and_lhs_gradient_equal_reference_and_per_group_products(dtype):
    x, packed, absmax, dy = _operands(jnp.dtype(dtype))
    sizes = jnp.asarray(SIZES)

    def run(impl):
        f = lambda a: ops.nf4_grouped_matmul(a, packed, absmax, sizes, shape=(N, K), blocksize=BLOCK,  # noqa: E731
                                             implementation=impl)
        y, pullback = jax.vjp(f, x)
        return y, pullback(dy)[0]

    y_ref, dx_ref = run("reference")
    y, dx = run("xla")
    assert y.dtype == x.dtype and dx.dtype == x.dtype
    assert _rel(y, y_ref) <= TOL[dtype] and _rel(dx, dx_ref) <= TOL[dtype]
    # Group by group, with the weights dequantised here in float32: y_g = x_g W_g^T, dx_g = dy_g W_g.
    w = ops.dequantize_groups(packed, absmax, shape=(N, K), blocksize=BLOCK, quant_type="nf4", dtype=jnp.float32)
    x32, dy32 = np.asarray(x, np.float32), np.asarray(dy, np.float32)
    want_y, want_dx = np.zeros_like(np.asarray(y, np.float32)), np.zeros_like(x32)
    start = 0
    for g, n in enumerate(SIZES):
        want_y[start:start + n] = x32[start:start + n] @ np.asarray(w[g]).T
        want_dx[start:start + n] = dy32[start:start + n] @ np.asarray(w[g])
        start += n
    assert _rel(y, want_y) <= TOL[dtype] and _rel(dx, want_dx) <= TOL[dtype]


def test_backward_keeps_no_dequantised_weight():
    x, packed, absmax, _ = _operands(jnp.float32)

    def residual_shapes(impl):
        f = lambda a: ops.nf4_grouped_matmul(a, packed, absmax, jnp.asarray(SIZES), shape=(N, K),  # noqa: E731
                                             blocksize=BLOCK, implementation=impl)
        _, pullback = jax.vjp(f, x)
        return {tuple(leaf.shape) for leaf in jax.tree.leaves(pullback) if hasattr(leaf, "shape")}

    assert {(G, K, N), (G, N, K)} & residual_shapes("reference")  # autodiff keeps the dequantised weights
    assert not {(G, K, N), (G, N, K)} & residual_shapes("xla")


def test_layer_scan_temp_memory_holds_no_dequantised_layers():
    """Eight 'layers' of 4-bit experts scanned, gradient w.r.t. the input: XLA's memory analysis of the
    compiled program. The reference saves every layer's dequantised [G, K, K] weights for the backward; the
    custom VJP keeps the 4-bit bytes only (temp well below the dequantised weights of all layers)."""
    layers, width = 8, 128
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((layers * G, width, width)).astype(np.float32) * 0.05)
    q = quantize_4bit_batch(w, blocksize=BLOCK, double_quant=False)
    packed = q["packed"].reshape(layers, G, -1)
    absmax = q["absmax"].reshape(layers, G, -1)
    sizes = jnp.asarray([3, 0, 2, 3], jnp.int32)
    x = jnp.asarray(rng.standard_normal((8, width)).astype(np.float32)).astype(jnp.bfloat16)

    def temp_bytes(impl):
        def loss(x):
            def layer(h, p):
                return ops.nf4_grouped_matmul(h, p[0], p[1], sizes, shape=(width, width), blocksize=BLOCK,
                                              implementation=impl), None
            return jnp.sum(jax.lax.scan(layer, x, (packed, absmax))[0].astype(jnp.float32))
        return jax.jit(jax.grad(loss)).lower(x).compile().memory_analysis().temp_size_in_bytes

    dequantised_all_layers = layers * G * width * width * 2  # bf16
    assert temp_bytes("reference") >= dequantised_all_layers
    assert temp_bytes("xla") < dequantised_all_layers / 3


def test_bad_inputs_are_one_line_errors():
    x, packed, absmax, _ = _operands(jnp.float32)
    sizes = jnp.asarray(SIZES)
    with pytest.raises(ValueError, match=r"grouped.py: lhs must be \[M, 64\]"):
        ops.nf4_grouped_matmul(x[:, :-1], packed, absmax, sizes, shape=(N, K), blocksize=BLOCK)
    with pytest.raises(ValueError, match=r"grouped.py: absmax must be \[4, 48\]"):
        ops.nf4_grouped_matmul(x, packed, absmax[:, :-1], sizes, shape=(N, K), blocksize=BLOCK)
    with pytest.raises(ValueError, match=r"grouped.py: packed must be uint8"):
        ops.nf4_grouped_matmul(x, packed[0], absmax, sizes, shape=(N, K), blocksize=BLOCK)
