"""`implementation="auto"` with per-batch metadata: dense batches take cuDNN, packed ones the Pallas kernel,
decided on the device from `AttentionMetadata.single_segment` (computed once per batch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.attention import attention_reference, dot_product_attention, make_metadata
from kernels_pallas.attention.flash import FWD_NAME
from kernels_pallas.attention.shapes import GPU_TEST_SHAPES, make_segment_ids
from gpu_helpers import FAST_COMPILE


def _qkv(b, t, h, kvh, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = [(b, t, h, d), (b, t, kvh, d), (b, t, kvh, d), (b, t, h, d)]
    return [jax.random.normal(key, s, jnp.float32).astype(jnp.bfloat16) for key, s in zip(ks, shapes)]


def test_single_segment_flag():
    dense = make_metadata(jnp.ones((2, 256), jnp.int32))
    packed = make_metadata(jnp.asarray(np.repeat([[1] * 100 + [2] * 156], 2, 0), jnp.int32))
    padded = make_metadata(jnp.asarray([[1] * 200 + [0] * 56, [1] * 256], jnp.int32))
    assert bool(dense.single_segment) and not bool(packed.single_segment) and not bool(padded.single_segment)


# Compiled without XLA's GEMM autotuning (12-23 s per program on the H200, measured; the only GEMMs are the
# reference's); one program per layout computes the output and the gradients, and its HLO is checked.


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_TEST_SHAPES[:2], ids=lambda s: s.layout)
def test_gpu_auto_dense_or_packed_matches_reference(shape):
    q, k, v, do = _qkv(shape.batch, shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim)
    seg = jnp.asarray(make_segment_ids(shape))
    meta = make_metadata(seg)

    # segment ids and metadata are arguments, as in training: were they closed-over constants, XLA would
    # fold the branch predicate and drop the other branch (seen on the device: the first version of this
    # test captured them and found only one kernel in the HLO).
    def fwd_bwd(attn):
        def f(q, k, v, do, seg, meta):
            out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, seg, meta), q, k, v)
            return (out,) + vjp(do)
        return jax.jit(f).lower(q, k, v, do, seg, meta).compile(compiler_options=FAST_COMPILE)

    auto = fwd_bwd(lambda q, k, v, seg, meta: dot_product_attention(
        q, k, v, segment_ids=seg, metadata=meta, implementation="auto"))
    ref = fwd_bwd(lambda q, k, v, seg, meta: attention_reference(q, k, v, segment_ids=seg))
    got, want = auto(q, k, v, do, seg, meta), ref(q, k, v, do, seg, meta)
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.max(np.abs(g - w)) <= 2e-2 * max(1.0, np.max(np.abs(w))), name
    text = auto.as_text()
    assert FWD_NAME in text and "cudnn" in text.lower()  # both branches compiled, chosen at run time
