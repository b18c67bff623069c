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


# ------------------------------------------------------------------------- the device-side choice, on the CPU
# `api._dense_or_packed` is `sink_attention(dense_or_packed_pair(cudnn_pair, flash_pair))`; here the dense pair
# is the pure-JAX one (`sinks.reference_pair`: cuDNN's statistics, the flash backward formula) and the flash
# kernels run in interpret mode, so the composition and its residual layout are checked off the GPU.
# 600 tokens: the metadata pads rows to 640, so the flash pair's padded rows (lse = +inf) are exercised.

def _choice(meta, t, d, window, scale):
    from kernels_pallas.attention.api import dense_or_packed_pair
    from kernels_pallas.attention.flash import flash_pair, metadata_arrays
    from kernels_pallas.attention.sinks import reference_pair, sink_attention

    static = dict(causal=True, sliding_window=window, scale=scale)
    pair = dense_or_packed_pair(reference_pair(**static), flash_pair(meta, t, d, interpret=True, **static))
    attend = sink_attention(*pair)
    return lambda q, k, v, sinks: attend(q, k, v, sinks, meta.single_segment, metadata_arrays(meta))


def _segments(t, packed):
    if not packed:
        return jnp.ones((1, t), jnp.int32)
    return jnp.asarray(np.repeat([1, 2, 3], [250, 190, t - 440])[None], jnp.int32)


# Dense rows without sinks, packed rows with them (the sink correction over the flash pair's padded rows); the
# correction over the dense (reference) pair alone: test_attention_sinks.
@pytest.mark.parametrize("packed,with_sinks", [(False, False), (True, True)], ids=["plain-dense", "sinks-packed"])
def test_dense_or_packed_pair_matches_the_reference(packed, with_sinks):
    b, t, h, kvh, d, window = 1, 600, 4, 2, 64, (None if packed else 128)
    scale = d ** -0.5
    ks = jax.random.split(jax.random.key(3), 5)
    q, k, v, do = (jax.random.normal(key, s, jnp.float32) for key, s in
                   zip(ks, [(b, t, h, d), (b, t, kvh, d), (b, t, kvh, d), (b, t, h, d)]))
    sinks = (jnp.log(jnp.float32(t)) / 2 + 2 * jax.random.normal(ks[4], (h,))) if with_sinks else None
    seg = _segments(t, packed)
    meta = make_metadata(seg, sliding_window=window)
    assert bool(meta.single_segment) is (not packed) and meta.padded_len > t
    ours = _choice(meta, t, d, window, scale)
    ref = lambda q, k, v, s: attention_reference(q, k, v, segment_ids=seg, sliding_window=window,  # noqa: E731
                                                 sinks=s, scale=scale)
    args = (q, k, v, sinks) if with_sinks else (q, k, v)

    def output_and_grads(fn):  # sinks differentiated when there are any; one program (not op-by-op compiles)
        def run(do, *args):
            out, pull = jax.vjp(lambda *a: fn(*a[:3], a[3] if with_sinks else None), *args)
            return [out, *pull(do)]
        return jax.jit(run)(do, *args)

    got, want = output_and_grads(ours), output_and_grads(ref)
    assert len(got) == 1 + len(args)
    for name, a, w in zip(["out", "dq", "dk", "dv", "dsinks"], got, want):
        w = np.asarray(w)
        assert np.abs(w).max() > 1e-3, name  # a real gradient
        np.testing.assert_allclose(np.asarray(a), w, atol=5e-5 * max(1.0, np.abs(w).max()), rtol=1e-4,
                                   err_msg=name)


def _name_sites(jaxpr, in_cond=False):
    """(residual name, whether it is inside a `cond` branch) for every checkpoint_name in a jaxpr, nested ones
    included."""
    import jax.extend

    sites = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            sites.append((eqn.params["name"], in_cond))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            sites += _name_sites(sub, in_cond or eqn.primitive.name == "cond")
    return sites


def test_dense_or_packed_names_its_residuals_outside_the_branches():
    """The H200 bug this layout fixes: a remat policy that offloads the attention residuals, over a `cond`
    whose branches named their own, made XLA's GPU layout assignment reject the conditional (api.py's
    `dense_or_packed_pair`). The names must sit on the cond's results, never inside a branch."""
    from kernels_pallas.attention.residuals import OUT_NAME, STATS_NAME

    t, d = 256, 64
    q, k, v = (jax.random.normal(jax.random.key(i), (1, t, 2, d)) for i in range(3))
    seg = _segments(t, packed=False)
    ours = _choice(make_metadata(seg), t, d, None, d ** -0.5)
    policy = jax.checkpoint_policies.save_only_these_names(OUT_NAME, STATS_NAME)
    loss = jax.checkpoint(lambda q, k, v: jnp.sum(ours(q, k, v, None) ** 2), policy=policy)
    sites = _name_sites(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr)
    assert {name for name, _ in sites} == {OUT_NAME, STATS_NAME}
    assert not [name for name, in_cond in sites if in_cond], sites
