"""`implementation="auto"` with per-batch metadata: dense batches take cuDNN, packed ones the Pallas kernel,
decided on the device from `AttentionMetadata.single_segment` (computed once per batch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.attention import attention_reference, dot_product_attention, make_metadata
from kernels_pallas.attention.flash import FWD_NAME


def _qkv(b, t, h, kvh, d, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = [(b, t, h, d), (b, t, kvh, d), (b, t, kvh, d), (b, t, h, d)]
    return [jax.random.normal(key, s, jnp.float32).astype(jnp.bfloat16) for key, s in zip(ks, shapes)]


def test_single_segment_flag():
    dense = make_metadata(jnp.ones((2, 256), jnp.int32))
    packed = make_metadata(jnp.asarray(np.repeat([[1] * 100 + [2] * 156], 2, 0), jnp.int32))
    padded = make_metadata(jnp.asarray([[1] * 200 + [0] * 56, [1] * 256], jnp.int32))
    assert bool(dense.single_segment) and not bool(packed.single_segment) and not bool(padded.single_segment)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["dense", "packed"])
def test_gpu_auto_dense_or_packed_matches_reference(layout):
    b, t, h, kvh, d = 2, 1024, 8, 2, 128
    q, k, v, do = _qkv(b, t, h, kvh, d)
    seg = jnp.ones((b, t), jnp.int32) if layout == "dense" else jnp.asarray(
        np.repeat([[1] * 300 + [2] * 500 + [3] * 224], b, 0), jnp.int32)
    meta = make_metadata(seg)

    # segment ids and metadata are arguments, as in training: were they closed-over constants, XLA would
    # fold the branch predicate and drop the other branch (seen on the device: the first version of this
    # test captured them and found only one kernel in the HLO).
    def auto(q, k, v, seg, meta):
        return dot_product_attention(q, k, v, segment_ids=seg, metadata=meta, implementation="auto")

    def ref(q, k, v):
        return attention_reference(q, k, v, segment_ids=seg)

    got, got_vjp = jax.vjp(lambda q, k, v: jax.jit(auto)(q, k, v, seg, meta), q, k, v)
    want, want_vjp = jax.vjp(ref, q, k, v)
    for name, g, w in [("out", got, want)] + list(zip("qkv", got_vjp(do), want_vjp(do))):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.max(np.abs(g - w)) <= 2e-2 * max(1.0, np.max(np.abs(w))), name
    text = jax.jit(auto).lower(q, k, v, seg, meta).compile().as_text()
    assert FWD_NAME in text and "cudnn" in text.lower()  # both branches compiled, chosen at run time
