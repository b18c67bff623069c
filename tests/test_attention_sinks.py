"""Attention sinks as a correction of sink-free attention (kernels_pallas/attention/sinks.py): with the pure-JAX
(forward-with-lse, flash-backward) pair, `sink_attention` equals the reference attention with sinks, forward and
every gradient (sinks included), at >= 512 tokens, causal and sliding-window, GQA; on the GPU the same with
cuDNN's pair, found by name in the compiled program, and `auto` sends dense rows with sinks to cuDNN."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.attention import attention_reference, dot_product_attention
from kernels_pallas.attention.config import choose_implementation
from kernels_pallas.attention.sinks import reference_pair, sink_attention
from gpu_helpers import FAST_COMPILE

ON_GPU = jax.default_backend() == "gpu"


def _inputs(b, t, h, kvh, d, dtype, seed):
    ks = jax.random.split(jax.random.key(seed), 5)
    q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(dtype)
               for key, shape in zip(ks[:3], [(b, t, h, d), (b, t, kvh, d), (b, t, kvh, d)]))
    do = jax.random.normal(ks[3], (b, t, h, d), jnp.float32).astype(dtype)
    # Sinks of the size of the row's log-sum-exp (~log T), so g = sigmoid(lse - s) is far from 0 and 1.
    sinks = jnp.log(jnp.float32(t)) / 2 + 2 * jax.random.normal(ks[4], (h,), jnp.float32)
    return q, k, v, do, sinks


def _vjp(fn, q, k, v, sinks, do):
    out, pull = jax.vjp(fn, q, k, v, sinks)
    return [out, *pull(do)]


@pytest.mark.parametrize("window,h,kvh", [(None, 4, 2), (128, 6, 1)])  # causal GQA; sliding-window MQA
def test_sink_correction_equals_the_reference_with_sinks(window, h, kvh):
    b, t, d = 1, 640, 32
    q, k, v, do, sinks = _inputs(b, t, h, kvh, d, jnp.float32, seed=h + (window or 0))
    scale = d ** -0.5
    ours = sink_attention(*reference_pair(causal=True, sliding_window=window, scale=scale))
    ref = lambda q, k, v, s: attention_reference(q, k, v, sliding_window=window, sinks=s, scale=scale)  # noqa: E731
    # one program per side (op by op, every eager op of a new shape compiles on its own)
    got, want = (jax.jit(lambda *a, f=f: _vjp(f, *a))(q, k, v, sinks, do) for f in (ours, ref))
    for name, a, b_ in zip(["out", "dq", "dk", "dv", "dsinks"], got, want):
        b_ = np.asarray(b_)
        np.testing.assert_allclose(np.asarray(a), b_, atol=2e-5 * max(1.0, np.abs(b_).max()), rtol=1e-4,
                                   err_msg=name)
        assert np.abs(b_).max() > 1e-3, name  # each compared gradient is a real one
    # The sinks matter here: without them the output differs by far more than the tolerance.
    plain = attention_reference(q, k, v, sliding_window=window, scale=scale)
    assert float(jnp.max(jnp.abs(plain - got[0]))) > 1e-2


def test_the_sink_path_names_its_residuals_for_remat_policies():
    from kernels_pallas.attention.residuals import OUT_NAME, STATS_NAME

    q, k, v, do, sinks = _inputs(1, 256, 2, 1, 16, jnp.float32, seed=0)
    ours = sink_attention(*reference_pair(causal=True, sliding_window=None, scale=0.25))
    policy = jax.checkpoint_policies.save_only_these_names(OUT_NAME, STATS_NAME)
    fn = jax.checkpoint(lambda q, k, v, s: jnp.sum(ours(q, k, v, s) ** 2), policy=policy)
    jaxpr = str(jax.make_jaxpr(jax.grad(fn, argnums=(0, 1, 2, 3)))(q, k, v, sinks))
    assert OUT_NAME in jaxpr and STATS_NAME in jaxpr


def test_auto_sends_dense_rows_with_sinks_to_cudnn_and_packed_rows_to_pallas():
    kw = dict(causal=True, sliding_window=None, logit_softcap=None, sinks=jnp.zeros(8), scale=0.125, backend="gpu")
    shape = (1, 4096, 64, 64)
    assert choose_implementation(shape, (1, 4096, 8, 64), jnp.bfloat16, False, **kw) == "cudnn"
    assert choose_implementation(shape, (1, 4096, 8, 64), jnp.bfloat16, True, **kw) == "pallas"
    assert choose_implementation(shape, (1, 4096, 8, 64), jnp.bfloat16, False,
                                 **dict(kw, sliding_window=128)) == "cudnn"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 128])
def test_cudnn_with_sinks_matches_the_reference_on_the_gpu(window):
    """GPT-OSS's attention shape (64 heads over 8 KV heads, head_dim 64) at 1024 tokens, bf16: forward and all
    gradients against the fp32 reference with sinks; the compiled step runs cuDNN's fused attention kernels. (At
    2048 tokens the fp32 reference's [64, T, T] scores and their gradients asked for a 4 GiB buffer, and on an H100
    a test worker's share of the GPU (8.7 GiB, scripts/gpu_check.sh) had not that much left.
    1024 tokens still span 8 windows of 128.)"""
    b, t, h, kvh, d = 1, 1024, 64, 8, 64
    q, k, v, do, sinks = _inputs(b, t, h, kvh, d, jnp.bfloat16, seed=7)
    fn = lambda q, k, v, s: dot_product_attention(q, k, v, sliding_window=window, sinks=s,  # noqa: E731
                                                  implementation="cudnn")
    ref = lambda q, k, v, s: attention_reference(q, k, v, sliding_window=window, sinks=s)  # noqa: E731

    # One compiled program per side, output and gradients together, without GEMM autotuning (gpu_helpers): the
    # first version ran the reference eagerly, op by op, and compiled the cuDNN side twice (35 s a case).
    def program(attn, dtype):
        def f(q, k, v, s, do):
            return _vjp(lambda q, k, v, s: attn(q.astype(dtype), k.astype(dtype), v.astype(dtype), s),
                        q, k, v, s, do.astype(dtype))
        return jax.jit(f).lower(q, k, v, sinks, do).compile(compiler_options=FAST_COMPILE)

    ours = program(fn, jnp.bfloat16)
    got, want = ours(q, k, v, sinks, do), program(ref, jnp.float32)(q, k, v, sinks, do)
    for name, a, b_ in zip(["out", "dq", "dk", "dv", "dsinks"], got, want):
        a, b_ = np.asarray(a, np.float32), np.asarray(b_, np.float32)
        err = np.abs(a - b_).max() / max(np.abs(b_).max(), 1e-6)
        assert err < 3e-2, (name, err)
    hlo = ours.as_text()
    assert "__cudnn$fmhaSoftmax" in hlo and "__cudnn$fmhaSoftmaxBackward" in hlo, "cuDNN kernels not in the program"
