"""kernels_pallas/fp8_matmul: the FP8-GEMM implementation ("xla_fp8", XLA's CPU upcasting its f8 dots here) equals
a NumPy emulation of its quantisation (per-token activations, per-channel weight, the weight's scale folded into
the output gradient) up to fp32 summation order and the reference (dequantise, then matmul) within FP8 error,
forward and input gradient; the dequantising "xla" implementation equals the reference; neither custom VJP keeps
more than the FP8 codes and scales; the lowered program holds f8 x f8 dots; `auto` picks FP8 GEMMs only on compute
capability 8.9+; bad inputs are one-line errors."""

from __future__ import annotations

import re
import types

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels_pallas import fp8_matmul as ops
from kernels_pallas.fp8_matmul.shapes import TEST_SHAPES, make_inputs


def _np_quantize_rows(a):
    """quantize_rows in NumPy float32 (ml_dtypes' float8_e4m3fn rounds to nearest even, as XLA converts)."""
    a = np.asarray(a, np.float32)
    scale = np.max(np.abs(a), axis=-1) * np.float32(1 / 448)
    safe = np.where(scale > 0, scale, np.float32(1))
    return np.clip(a / safe[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn), scale


def _np_fp8_matmul(x, q, scale, dy):
    """(y, dx) of the FP8-GEMM implementation, emulated: exact products of e4m3 values summed in float64, each GEMM
    written in the compute dtype, then scaled in float32."""
    f32, out = np.float32, np.asarray(x).dtype
    q, scale = np.asarray(q), np.asarray(scale)
    q_x, s_x = _np_quantize_rows(x)
    acc = (q_x.astype(np.float64) @ q.astype(np.float64).T).astype(out).astype(f32)
    y = acc * s_x[:, None] * scale[None, :]
    q_g, s_g = _np_quantize_rows(np.asarray(dy, f32) * scale[None, :])
    dx = (q_g.astype(np.float64) @ q.astype(np.float64)).astype(out).astype(f32) * s_g[:, None]
    return y, dx


def _frob(a, b) -> float:
    a, b = np.asarray(a).astype(np.float64), np.asarray(b).astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _vjp(impl, x, q, scale, dy):
    y, pullback = jax.vjp(lambda a: ops.fp8_matmul(a, q, scale, implementation=impl), x)
    return y, pullback(dy)[0]


@pytest.fixture(scope="module", params=TEST_SHAPES, ids=lambda s: s.name)
def case(request):
    x, w, dy = make_inputs(request.param)
    w = w.at[3].set(0.0)  # a zero output channel: scale 0, codes 0, no NaN
    q, scale = ops.quantize_rows(w)
    return request.param, x, w, q, scale, dy


def test_quantize_rows_is_the_numpy_rounding_bit_for_bit(case):
    _, x, w, q, scale, _ = case
    for a, (got_q, got_s) in ((w, (q, scale)), (x, ops.quantize_rows(x))):
        want_q, want_s = _np_quantize_rows(a)
        assert got_q.dtype == jnp.float8_e4m3fn and got_s.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got_s), want_s)
        np.testing.assert_array_equal(np.asarray(got_q).view(np.uint8), want_q.view(np.uint8))
    assert float(scale[3]) == 0.0 and not np.asarray(q[3], np.float32).any()
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == 448.0  # each row's amax lands on e4m3's largest


def test_fp8_gemms_equal_their_numpy_emulation_and_the_reference_within_fp8_error(case):
    shape, x, w, q, scale, dy = case
    y, dx = _vjp("xla_fp8", x, q, scale, dy)
    assert y.dtype == dx.dtype == x.dtype and y.shape == (shape.m, shape.out_features) and dx.shape == x.shape
    y_np, dx_np = _np_fp8_matmul(x, q, scale, dy)
    # Up to the fp32 summation order (float32 activations), or to one rounding to bf16.
    tol = 1e-5 if shape.dtype == "float32" else 2.0 ** -8
    for got, want in ((y, y_np), (dx, dx_np)):
        got = np.asarray(got, np.float32)
        assert np.all(np.abs(got - want) <= tol * np.abs(want) + 1e-6 * np.max(np.abs(want)))
    # Against the reference on the same stored weight (autodiff): only x and dy are rounded to e4m3 in addition.
    y_ref, dx_ref = _vjp("reference", x, q, scale, dy)
    assert _frob(y, y_ref) < 0.05 and _frob(dx, dx_ref) < 0.05
    # And the stored weight itself is within e4m3's error of the original.
    assert _frob(ops.dequantize_fp8(q, scale, jnp.float32), w) < 0.04


def test_dequantising_xla_equals_the_reference(case):
    _, x, _, q, scale, dy = case
    (y, dx), (y_ref, dx_ref) = _vjp("xla", x, q, scale, dy), _vjp("reference", x, q, scale, dy)
    assert y.dtype == dx.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32), rtol=1e-6, atol=1e-6)


def test_custom_vjps_keep_only_codes_and_scales():
    shape = TEST_SHAPES[0]
    x, w, _ = make_inputs(shape)
    q, scale = ops.quantize_rows(w)

    def residuals(impl):
        _, pullback = jax.vjp(lambda a: ops.fp8_matmul(a, q, scale, implementation=impl), x)
        return sorted((tuple(r.shape), str(r.dtype)) for r in jax.tree.leaves(pullback) if hasattr(r, "shape"))

    dims = (shape.out_features, shape.in_features)
    assert (dims, "float32") in residuals("reference")  # autodiff keeps the dequantised weight
    for impl in ("xla", "xla_fp8"):
        assert residuals(impl) == sorted([(dims, "float8_e4m3fn"), (dims[:1], "float32")])


def test_lowered_program_has_f8_dots_under_the_op_name():
    shape = TEST_SHAPES[1]
    x, w, dy = make_inputs(shape)
    q, scale = ops.quantize_rows(w)
    lowered = jax.jit(lambda a, qq, s, g: _vjp("xla_fp8", a, qq, s, g)).lower(x, q, scale, dy)
    dots = [ln for ln in lowered.as_text().splitlines() if "dot_general" in ln]
    # e4m3 x e4m3, written in the compute dtype (bf16 here; the GEMM accumulates in fp32)
    assert len(dots) == 2 and all(ln.count("f8E4M3FN") == 2 and ln.endswith("xbf16>") for ln in dots)
    # Compiled for the CPU (which upcasts the f8 dots): the activations and gradients are rounded to e4m3 in the
    # program, and both GEMMs carry the op's names (what the GPU test finds as cuBLASLt FP8 calls).
    compiled = lowered.compile().as_text()
    to_f8 = re.findall(r"= f8e4m3fn\[[\d,]+\]\S* convert\(.*?op_name=\"([^\"]*)\"", compiled)
    assert any(f"jvp({ops.SCOPE})" in n for n in to_f8) and any(f"{ops.SCOPE}_dx" in n for n in to_f8)
    gemms = re.findall(r" dot\(.*?op_name=\"([^\"]*)\"", compiled)
    assert sorted(n.split("/")[1] for n in gemms) == [f"jvp({ops.SCOPE})", f"transpose(jvp({ops.SCOPE}_dx))"]


def test_auto_picks_fp8_gemms_only_with_fp8_tensor_cores():
    assert ops.OP.resolve("auto").name == "xla"  # here: the CPU
    for cc, fp8 in (("9.0", True), ("8.9", True), ("10.0", True), ("8.6", False), ("8.0", False), ("", False)):
        device = types.SimpleNamespace(platform="gpu", compute_capability=cc)
        assert ops.has_fp8_tensor_cores(device) is fp8
        assert ops.OP.resolve("auto", device).name == ("xla_fp8" if fp8 else "xla")


def test_bad_inputs_are_one_line_errors():
    x, w, _ = make_inputs(TEST_SHAPES[0])
    q, scale = ops.quantize_rows(w)
    with pytest.raises(ValueError, match="does not end in in_features"):
        ops.fp8_matmul(x[:, :-1], q, scale)
    with pytest.raises(ValueError, match=r"scale \(95,\) must be \[out\]"):
        ops.fp8_matmul(x, q, scale[:-1])
    with pytest.raises(ValueError, match="q must be float8_e4m3fn"):
        ops.fp8_matmul(x, w, scale)
    with pytest.raises(ValueError, match="no implementation='pallas'"):
        ops.fp8_matmul(x, q, scale, implementation="pallas")
