"""On the GPU: jaxft's 4-bit quantiser (default nested_rounding="cuda") against bitsandbytes' CUDA kernels,
byte for byte, and dequantised values equal. Needs bitsandbytes with its CUDA library on the device machine."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("out_f,in_f,blocksize", [(4096, 1024, 64), (1024, 4096, 128), (512, 768, 32)])
def test_quantiser_bytes_equal_bitsandbytes_cuda(out_f, in_f, blocksize):
    F = pytest.importorskip("bitsandbytes.functional")
    import torch
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    import jax.numpy as jnp

    from jaxft.quant import blockwise
    from kernels_pallas import nf4_matmul

    rng = np.random.default_rng(out_f)
    w = (rng.standard_normal((out_f, in_f)) * 0.02).astype(np.float32)
    ref_q, state = F.quantize_4bit(torch.from_numpy(w).cuda().bfloat16(), blocksize=blocksize, quant_type="nf4",
                                   compress_statistics=True)
    ours = blockwise.quantize_4bit(jnp.asarray(w).astype(jnp.bfloat16), blocksize=blocksize)
    assert np.array_equal(np.asarray(ours.packed), ref_q.cpu().numpy().reshape(-1))
    offset = np.float32(state.offset.item())
    fp32_absmax = blockwise.quantize_4bit(jnp.asarray(w).astype(jnp.bfloat16), blocksize=blocksize,
                                          double_quant=False).absmax
    q, nested, _ = blockwise.double_quantize(fp32_absmax, offset=offset)  # the CUDA rule is the default
    assert np.array_equal(np.asarray(q), state.absmax.cpu().numpy())
    assert np.array_equal(np.asarray(nested), state.state2.absmax.cpu().numpy())
    ref = F.dequantize_4bit(ref_q, state).float().cpu().numpy()
    got = nf4_matmul.dequantize_4bit(ours.packed, blockwise.dequantize_absmax(q, nested, offset), shape=(out_f, in_f),
                                     blocksize=blocksize, dtype=jnp.bfloat16)
    assert np.array_equal(np.asarray(got, np.float32), ref)
