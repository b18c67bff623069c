"""jaxft's 4-bit quantiser against bitsandbytes on CPU (the oracle): packed bytes, absmax, double-quantised absmax
and dequantised values, for several shapes, block sizes, NF4 and FP4, float32 and bfloat16 weights."""

from __future__ import annotations

import numpy as np
import pytest

bnb_functional = pytest.importorskip("bitsandbytes.functional")
import torch  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxft.quant import blockwise  # noqa: E402
from kernels_pallas import nf4_matmul  # noqa: E402
from kernels_pallas.nf4_matmul.codes import DYNAMIC, FP4, NF4  # noqa: E402

# jitted: one program per shape (op by op, every eager op of a new shape compiles on its own)
_dequantize_4bit = jax.jit(nf4_matmul.dequantize_4bit, static_argnames=("shape", "blocksize", "quant_type", "dtype"))


def _bnb_dequantize_4bit(packed, absmax, quant_type, blocksize, shape, dtype) -> np.ndarray:
    """bitsandbytes' own dequantisation of 4-bit bytes, in its generic implementation: blocks of `blocksize` over
    the flattened weight, as its CUDA kernel and the checkpoint format have them. Not its CPU C kernel: on an x86 CPU
    where bitsandbytes loads that library it blocks each ROW (seen with bitsandbytes 0.50.2 on an AVX-512 Xeon: it
    disagrees with bitsandbytes' generic and CUDA paths, and with its own quantiser's bytes, whenever the row length
    is not a multiple of the block), so `functional.dequantize_4bit` is a different oracle on different machines.
    bitsandbytes itself falls back to this generic code for odd rows and, with AVX-512, for blocks >= 2048."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    code = _get_4bit_code(quant_type, packed.device)
    return _dequantize_4bit_compute(packed.reshape(-1).view(torch.uint8), absmax.float(), code, blocksize, shape,
                                    dtype).float().numpy()

# (out, in, blocksize): block-aligned projections, one whose size is not a multiple of the block (a partial last
# block, handled by the same formula) and the extreme block sizes.
CASES = [(96, 64, 64), (48, 80, 32), (64, 96, 128), (40, 72, 4096), (128, 192, 256), (20, 24, 64)]


def _weight(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * 0.02
    w[0, :3] = 0.0  # exact zeros and a large outlier: both ends of the code
    w[-1, -1] = 0.3
    t = torch.from_numpy(w).to(dtype)
    return t, jnp.asarray(t.float().numpy()).astype(jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32)


def test_code_books_are_bitsandbytes():
    assert np.array_equal(bnb_functional.get_4bit_type("nf4", device="cpu").numpy(), NF4)
    assert np.array_equal(bnb_functional.get_4bit_type("fp4", device="cpu").numpy(), FP4)
    assert np.array_equal(bnb_functional.create_dynamic_map().numpy(), DYNAMIC)


# Every shape in NF4 float32; FP4 in bfloat16 on a block-aligned shape and a partial last block (the code book only
# changes the table the same blocking reads), and the first shape in the other two pairs: the dtype only changes the
# input's rounding, which every pair sees.
_BYTE_CASES = ([("nf4", torch.float32, *c) for c in CASES]
               + [("fp4", torch.bfloat16, *c) for c in (CASES[0], CASES[-1])]
               + [("nf4", torch.bfloat16, *CASES[0]), ("fp4", torch.float32, *CASES[0])])


@pytest.mark.parametrize("quant_type,dtype,out_f,in_f,blocksize", _BYTE_CASES,
                         ids=[f"{q}-{'f32' if d == torch.float32 else 'bf16'}-{o}-{i}-{b}" for q, d, o, i, b in
                              _BYTE_CASES])
def test_packed_bytes_and_absmax_equal_bitsandbytes(quant_type, dtype, out_f, in_f, blocksize):
    t, w = _weight((out_f, in_f), dtype, seed=out_f + in_f + blocksize)
    ref_q, ref_state = bnb_functional.quantize_4bit(t, blocksize=blocksize, quant_type=quant_type,
                                                    compress_statistics=False)
    ours = blockwise.quantize_4bit(w, quant_type=quant_type, blocksize=blocksize, double_quant=False)
    assert np.array_equal(np.asarray(ours.packed), ref_q.numpy().reshape(-1))
    assert np.asarray(ours.absmax).dtype == np.float32
    assert np.array_equal(np.asarray(ours.absmax), ref_state.absmax.numpy())
    # Dequantised: bitsandbytes' own dequantisation of the same bytes, in the weight's dtype.
    ref = _bnb_dequantize_4bit(ref_q, ref_state.absmax, quant_type, blocksize, (out_f, in_f), t.dtype)
    got = _dequantize_4bit(ours.packed, ours.absmax, shape=(out_f, in_f), blocksize=blocksize,
                           quant_type=quant_type, dtype=w.dtype)
    assert np.array_equal(np.asarray(got, np.float32), ref)


@pytest.mark.parametrize("out_f,in_f,blocksize", [(256, 384, 64), (96, 64, 64), (512, 200, 32), (64, 96, 128)])
def test_double_quant_equals_bitsandbytes(out_f, in_f, blocksize):
    t, w = _weight((out_f, in_f), torch.float32, seed=7 + out_f)
    ref_q, ref_state = bnb_functional.quantize_4bit(t, blocksize=blocksize, quant_type="nf4", compress_statistics=True)
    ours = blockwise.quantize_4bit(w, blocksize=blocksize, double_quant=True, nested_rounding="cpu")
    assert np.array_equal(np.asarray(ours.packed), ref_q.numpy().reshape(-1))
    # The offset is the correctly rounded float32 mean; torch's float32 summation may land an ulp or two away.
    ref_offset = np.float32(ref_state.offset.item())
    assert abs(np.float32(ours.offset) - ref_offset) <= 2 * np.spacing(ref_offset)
    # With the same offset, the nested codes and absmax are byte-identical.
    fp32_absmax = blockwise.quantize_4bit(w, blocksize=blocksize, double_quant=False).absmax
    q, nested, _ = blockwise.double_quantize(fp32_absmax, rounding="cpu", offset=ref_offset)
    assert np.array_equal(np.asarray(q), ref_state.absmax.numpy())
    assert np.array_equal(np.asarray(nested), ref_state.state2.absmax.numpy())
    # The de-nested absmax, and the weight, as bitsandbytes dequantises them.
    ref_absmax = bnb_functional.dequantize_blockwise(ref_state.absmax, ref_state.state2) + ref_state.offset
    assert np.array_equal(np.asarray(blockwise.dequantize_absmax(q, nested, ref_offset)), ref_absmax.numpy())
    ref = _bnb_dequantize_4bit(ref_q, ref_absmax, "nf4", blocksize, (out_f, in_f), torch.float32)
    got = _dequantize_4bit(ours.packed, blockwise.dequantize_absmax(q, nested, ref_offset),
                           shape=(out_f, in_f), blocksize=blocksize, dtype=jnp.float32)
    assert np.array_equal(np.asarray(got), ref)


def test_8bit_blockwise_equals_bitsandbytes_cpu_and_cuda_rule_is_nearest():
    rng = np.random.default_rng(3)
    for n in (1, 255, 256, 1000, 4099):
        v = (rng.standard_normal(n) * 0.01).astype(np.float32)
        ref, state = bnb_functional.quantize_blockwise(torch.from_numpy(v), blocksize=256)
        q, absmax = blockwise.quantize_blockwise_8bit(v, rounding="cpu")
        assert np.array_equal(np.asarray(q), ref.numpy()) and np.array_equal(np.asarray(absmax), state.absmax.numpy())
        # The CUDA kernel's rule: the nearest code value of the normalised input.
        qc, _ = blockwise.quantize_blockwise_8bit(v, rounding="cuda")
        x = v / np.repeat(np.asarray(absmax), 256)[:n]
        nearest = np.abs(x[:, None] - DYNAMIC[None, :]).min(axis=1)
        assert np.allclose(np.abs(x - DYNAMIC[np.asarray(qc)]), nearest, rtol=0, atol=1e-7)


def test_bad_settings_are_one_line_errors():
    w = jnp.zeros((4, 64))
    with pytest.raises(ValueError, match="blocksize=48"):
        blockwise.quantize_4bit(w, blocksize=48)
    with pytest.raises(ValueError, match="quant_type='int4'"):
        blockwise.quantize_4bit(w, quant_type="int4")
    with pytest.raises(ValueError, match="nested_rounding='gpu'"):
        blockwise.quantize_4bit(w, nested_rounding="gpu")
