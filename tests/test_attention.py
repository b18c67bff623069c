"""Attention: the pure-JAX reference vs transformers' eager attention (torch, fp32), and the
Pallas flash kernels (interpret mode on CPU, compiled on GPU) vs the reference.

Oracles: transformers.models.gemma2 eager attention (GQA, soft-capping, mask) and
transformers.models.gpt_oss eager attention (GQA, sinks, mask), forward and
autograd gradients.  The kernels are then checked against the reference for
every feature: causal, GQA/MQA, head_dim 64/128/256, packed ragged segments
(a document spanning several blocks, one-token documents, rows ending in
padding, T not a block multiple), sliding window, softcap, sinks, bf16.
"""

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.attention import attention_reference, dot_product_attention, make_metadata
from kernels_pallas.attention.shapes import GPU_TEST_SHAPES, make_segment_ids
from kernels_pallas.attention.config import BlockConfig, FlashConfig
from kernels_pallas.attention.flash import DKDV_NAME, DQ_NAME, FWD_NAME, flash_attention
from gpu_helpers import compile_fast

ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def ragged_segments(b, t):
    """Rows: two docs crossing block edges then padding; a one-token doc and a
    doc spanning several blocks; dense; many short docs ending in padding."""
    seg = np.zeros((b, t), np.int32)
    layouts = [
        [(0, 100, 1), (100, int(t * 0.9), 2)],
        [(0, 5, 1), (5, 6, 2), (6, int(t * 0.8), 3), (int(t * 0.8), t, 4)],
        [(0, t, 1)],
        [(s, min(s + 23, t - 9), 1 + s // 23) for s in range(0, t - 9, 23)],
    ]
    for r in range(b):
        for s, e, i in layouts[r % len(layouts)]:
            seg[r, s:e] = i
    return jnp.asarray(seg)


# Inputs and block metadata jitted, one program per shape (op by op, every eager op of a new shape compiles on its own).
@functools.partial(jax.jit, static_argnames=("b", "t", "h", "kvh", "d", "dtype", "seed"))
def _inputs(b, t, h, kvh, d, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (b, t, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, t, kvh, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, t, kvh, d), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (b, t, h, d), jnp.float32).astype(dtype)
    sinks = jax.random.normal(ks[4], (h,), jnp.float32)
    return q, k, v, do, sinks


_metadata = jax.jit(make_metadata, static_argnames=("causal", "sliding_window", "block_q", "block_k"))


def _fwd_and_grads(fn, q, k, v, do, sinks, use_sinks):
    def f(q, k, v, s):
        return fn(q, k, v, s if use_sinks else None)

    o, vjp = jax.vjp(f, q, k, v, sinks)
    return (o,) + vjp(do)


def _jit_fwd_and_grads(fn, q, k, v, do, sinks, use_sinks):
    """`_fwd_and_grads` as one compiled program (op by op, every eager op of a new shape compiles on its own)."""
    return jax.jit(lambda *a: _fwd_and_grads(fn, *a, use_sinks))(q, k, v, do, sinks)


def _assert_close(got, want, rel, what):
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    scale = max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    assert err <= rel * scale, f"{what}: max |err| {err:.3g} > {rel} * {scale:.3g}"


# ---------------------------------------------------------------------------
# Reference (implementation="reference") vs transformers eager attention in torch.
# ---------------------------------------------------------------------------
torch = pytest.importorskip("torch")


def _torch_mask(seg, causal, window):
    seg = np.asarray(seg)
    t = seg.shape[1]
    i = np.arange(t)[:, None]
    j = np.arange(t)[None, :]
    keep = seg[:, :, None] == seg[:, None, :]
    if causal:
        keep = keep & (i >= j)
    if window is not None:
        keep = keep & (i - j < window)
    return torch.tensor(np.where(keep, 0.0, np.finfo(np.float32).min)[:, None], dtype=torch.float32)


def _torch_oracle(model, q, k, v, do, sinks, seg, causal, window, softcap):
    """Forward + grads from transformers' eager attention (layout [B,H,T,D])."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gptoss_eager

    tq, tk, tv = (torch.tensor(np.asarray(x, np.float32)).transpose(1, 2).requires_grad_() for x in (q, k, v))
    ts = torch.tensor(np.asarray(sinks, np.float32), requires_grad=True)
    mod = types.SimpleNamespace(num_key_value_groups=q.shape[2] // k.shape[2], training=False,
                                head_dim=q.shape[3], sinks=ts)
    mask = _torch_mask(seg, causal, window)
    scale = q.shape[3] ** -0.5
    if model == "gemma2":
        out, _ = gemma2_eager(mod, tq, tk, tv, mask, dropout=0.0, scaling=scale, softcap=softcap)
    else:
        out, _ = gptoss_eager(mod, tq, tk, tv, mask, scaling=scale, dropout=0.0)
    out.backward(torch.tensor(np.asarray(do, np.float32)))
    grads = [x.grad.transpose(1, 2).numpy() for x in (tq, tk, tv)]
    dsinks = ts.grad.numpy() if ts.grad is not None else np.zeros(ts.shape, np.float32)
    return [out.detach().numpy()] + grads + [dsinks]


@pytest.mark.parametrize(
    "model,causal,window,softcap,h,kvh",
    [
        ("gemma2", True, 96, 5.0, 4, 1),  # MQA + sliding window + softcap
        ("gemma2", False, None, None, 4, 4),  # bidirectional MHA
        ("gptoss", True, 128, None, 6, 2),  # sinks + window, G=3
    ],
)
def test_reference_matches_transformers_eager(model, causal, window, softcap, h, kvh):
    b, t, d = 4, 512, 32
    q, k, v, do, sinks = _inputs(b, t, h, kvh, d, jnp.float32, seed=3)
    seg = ragged_segments(b, t)
    use_sinks = model == "gptoss"
    got = _jit_fwd_and_grads(
        lambda q, k, v, s: dot_product_attention(
            q, k, v, segment_ids=seg, causal=causal, sliding_window=window,
            logit_softcap=softcap, sinks=s, implementation="reference"),
        q, k, v, do, sinks, use_sinks)
    want = _torch_oracle(model, q, k, v, do, sinks, seg, causal, window, softcap)
    names = ["out", "dq", "dk", "dv", "dsinks"]
    for name, g, w in zip(names, got, want):
        if name == "dsinks" and not use_sinks:
            continue
        _assert_close(g, w, 2e-5, name)


# ---------------------------------------------------------------------------
# Pallas kernels vs the reference (interpret mode on CPU).
# ---------------------------------------------------------------------------
KERNEL_CASES = {
    # name: (b, t, h, kvh, d, dtype, causal, window, softcap, sinks, segments): the kernels' forward and custom VJP
    # with every feature on, in fp32 (tight tolerance); MQA and kernel tiles finer than the metadata blocks in the
    # next test. head_dim 128 and 256, bidirectional, MQA at head_dim 64 and bf16 (every case) run natively in
    # test_gpu_pallas_matches_reference_bf16 and test_gpu_conservative_tiles_compile_and_match_reference.
    "window_cap_sinks_f32": (4, 256, 4, 2, 64, jnp.float32, True, 80, 20.0, True, True),
}
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_pallas_matches_reference(name):
    b, t, h, kvh, d, dtype, causal, window, softcap, use_sinks, packed = KERNEL_CASES[name]
    q, k, v, do, sinks = _inputs(b, t, h, kvh, d, dtype)
    seg = ragged_segments(b, t) if packed else None
    md = _metadata(seg if packed else jnp.ones((b, t), jnp.int32), causal=causal,
                       sliding_window=window, block_q=64, block_k=64)
    kw = dict(causal=causal, sliding_window=window, logit_softcap=softcap)
    got = _jit_fwd_and_grads(
        lambda q, k, v, s: dot_product_attention(q, k, v, segment_ids=seg, metadata=md, sinks=s,
                                                 implementation="pallas", **kw),
        q, k, v, do, sinks, use_sinks)
    # Reference on the same (possibly bf16-rounded) inputs, computed in fp32.
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = _jit_fwd_and_grads(
        lambda q, k, v, s: attention_reference(q, k, v, segment_ids=seg, sinks=s, **kw),
        f32(q), f32(k), f32(v), f32(do), sinks, use_sinks)
    for what, g, w in zip(["out", "dq", "dk", "dv", "dsinks"], got, want):
        if what == "dsinks" and not use_sinks:
            continue
        assert g.dtype == (jnp.float32 if what == "dsinks" else dtype)
        _assert_close(g, w, TOL[dtype], f"{name}/{what}")


def test_kernel_tiles_finer_than_metadata_blocks():
    """Kernel tiles (16/32) inside 64x64 metadata blocks, packed + window + causal."""
    b, t, h, kvh, d = 2, 256, 2, 1, 64
    q, k, v, do, sinks = _inputs(b, t, h, kvh, d, jnp.float32, seed=1)
    seg = ragged_segments(b, t)
    md = _metadata(seg, sliding_window=70, block_q=64, block_k=64)
    cfg = FlashConfig(BlockConfig(32, 16), BlockConfig(16, 32), BlockConfig(32, 16))
    got = _jit_fwd_and_grads(
        lambda q, k, v, s: flash_attention(q, k, v, md, sliding_window=70, sinks=s, config=cfg),
        q, k, v, do, sinks, True)
    want = _jit_fwd_and_grads(
        lambda q, k, v, s: attention_reference(q, k, v, segment_ids=seg, sliding_window=70, sinks=s),
        q, k, v, do, sinks, True)
    for what, g, w in zip(["out", "dq", "dk", "dv", "dsinks"], got, want):
        _assert_close(g, w, 2e-5, what)


# ---------------------------------------------------------------------------
# Lowering, naming, API behaviour.
# ---------------------------------------------------------------------------
def _flash_grad_fn(window=128):
    def f(q, k, v, seg, s):
        md = make_metadata(seg, sliding_window=window)
        return jax.grad(
            lambda q, k, v, s: flash_attention(q, k, v, md, sliding_window=window, logit_softcap=30.0,
                                               sinks=s, interpret=False).astype(jnp.float32).sum(),
            argnums=(0, 1, 2, 3))(q, k, v, s)
    return f


def test_kernels_lower_to_named_triton_calls_for_hopper():
    """Cross-lower (no GPU needed) for an abstract H200: all three kernels are
    Triton custom calls carrying our pallas_call names."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                        abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                                       platform="gpu"))
    b, t, h, kvh, d = 1, 512, 4, 2, 128
    args = (jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, t, kvh, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, t, kvh, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, t), jnp.int32),
            jax.ShapeDtypeStruct((h,), jnp.float32))
    with use_abstract_mesh(mesh):
        text = jax.jit(_flash_grad_fn()).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    names = re.findall(r'custom_call @__gpu\$xla\.gpu\.triton.*?name = "(\w+)"', text)
    assert sorted(names) == sorted([FWD_NAME, DQ_NAME, DKDV_NAME])


def test_api_validates_inputs():
    q = jnp.zeros((1, 128, 4, 64))
    k = jnp.zeros((1, 128, 3, 64))
    with pytest.raises(ValueError, match="multiple of num kv heads"):
        dot_product_attention(q, k, k)
    k = jnp.zeros((1, 128, 2, 64))
    with pytest.raises(ValueError, match="implementation"):
        dot_product_attention(q, k, k, implementation="triton")
    with pytest.raises(ValueError, match=r"sinks shape"):
        dot_product_attention(q, k, k, sinks=jnp.zeros(2))
    md = make_metadata(jnp.ones((1, 128), jnp.int32), sliding_window=16)
    with pytest.raises(ValueError, match="rebuild it with make_metadata"):
        dot_product_attention(q, k, k, metadata=md, implementation="pallas")
    with pytest.raises(ValueError, match="head_dim=32"):
        dot_product_attention(jnp.zeros((1, 128, 4, 32)), jnp.zeros((1, 128, 2, 32)),
                              jnp.zeros((1, 128, 2, 32)), implementation="pallas")


def test_auto_uses_a_supported_implementation():
    q, k, v, _, sinks = _inputs(1, 128, 4, 2, 64, jnp.float32)
    got = jax.jit(lambda q, k, v, s: dot_product_attention(q, k, v, sinks=s, logit_softcap=5.0,
                                                           implementation="auto"))(q, k, v, sinks)
    want = jax.jit(lambda q, k, v, s: attention_reference(q, k, v, sinks=s, logit_softcap=5.0))(q, k, v, sinks)
    _assert_close(got, want, 2e-5, "auto")


def test_cudnn_segment_runs():
    from kernels_pallas.attention.cudnn import segment_runs

    seg = jnp.array([[1, 1, 1, 2, 2, 0, 0, 0], [3, 3, 3, 3, 3, 3, 3, 3]], jnp.int32)
    offsets, lens = segment_runs(seg, 4)
    np.testing.assert_array_equal(offsets, [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1]])
    np.testing.assert_array_equal(lens, [[3, 2, 3, -1], [8, -1, -1, -1]])


# ---------------------------------------------------------------------------
# On the device.  Programs are compiled without XLA's GEMM autotuning (it cost 12-23 s per program on the
# H200, measured) and with cuBLAS GEMMs (gpu_helpers.FAST_COMPILE): the reference's einsums are the only GEMMs,
# and the kernels under test are ours.
# ---------------------------------------------------------------------------
GPU_CASES = [
    # (t, h, kvh, d, causal, window, softcap, sinks, packed)
    (512, 8, 2, 128, True, None, None, False, False),
    (512, 8, 2, 128, True, None, None, False, True),
    (512, 8, 1, 64, True, 200, 30.0, True, True),
    (500, 4, 2, 256, True, None, 20.0, True, True),
    (512, 8, 8, 128, False, 100, None, False, True),
]

_gpu_compile = compile_fast


@pytest.fixture(scope="module")
def gpu_case_results():
    """Per GPU case: (compiled Pallas fwd+bwd program, its outputs, the fp32 reference's); compiled once per
    module, shared by the agreement test and the HLO check."""
    cache = {}

    def get(case):
        if case not in cache:
            t, h, kvh, d, causal, window, softcap, use_sinks, packed = case
            b = 2
            q, k, v, do, sinks = _inputs(b, t, h, kvh, d, jnp.bfloat16)
            seg = ragged_segments(b, t) if packed else jnp.ones((b, t), jnp.int32)
            kw = dict(causal=causal, sliding_window=window, logit_softcap=softcap)
            md = make_metadata(seg, causal=causal, sliding_window=window)

            def pallas(q, k, v, do, s, seg, md):
                return _fwd_and_grads(lambda q, k, v, s: dot_product_attention(
                    q, k, v, segment_ids=seg, metadata=md, sinks=s, implementation="pallas", **kw),
                    q, k, v, do, s, use_sinks)

            def ref(q, k, v, do, s, seg):
                return _fwd_and_grads(lambda q, k, v, s: attention_reference(
                    q, k, v, segment_ids=seg, sinks=s, **kw), q, k, v, do, s, use_sinks)

            compiled = _gpu_compile(pallas, q, k, v, do, sinks, seg, md)
            f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
            want = _gpu_compile(ref, *f32, sinks, seg)(*f32, sinks, seg)
            cache[case] = (compiled, compiled(q, k, v, do, sinks, seg, md), want)
        return cache[case]

    return get


@pytest.mark.gpu
@pytest.mark.xdist_group("attention_gpu_cases")  # one worker: they share gpu_case_results' compiles
@needs_gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_pallas_matches_reference_bf16(case, gpu_case_results):
    use_sinks = case[7]
    _, got, want = gpu_case_results(case)
    for what, g, w in zip(["out", "dq", "dk", "dv", "dsinks"], got, want):
        if what == "dsinks" and not use_sinks:
            continue
        _assert_close(g, w, 2e-2, what)


@pytest.mark.gpu
@pytest.mark.xdist_group("attention_gpu_cases")
@needs_gpu
def test_gpu_compiled_hlo_contains_named_kernels(gpu_case_results):
    compiled, _, _ = gpu_case_results(GPU_CASES[2])  # window + softcap + sinks: all three kernels
    text = compiled.as_text()
    for name in (FWD_NAME, DQ_NAME, DKDV_NAME):
        assert name in text, name


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_conservative_tiles_compile_and_match_reference(head_dim):
    """The tiling every non-H200 GPU gets (config.CONSERVATIVE_TILES) builds and is exact on this GPU."""
    from kernels_pallas.attention.config import CONSERVATIVE_TILES

    b, t, h, kvh = 2, 512, 4, 2
    q, k, v, do, sinks = _inputs(b, t, h, kvh, head_dim, jnp.bfloat16)
    seg = ragged_segments(b, t)
    md = make_metadata(seg, sliding_window=200)
    cfg = CONSERVATIVE_TILES[head_dim]

    def pallas(q, k, v, do, s, md):
        return _fwd_and_grads(lambda q, k, v, s: flash_attention(
            q, k, v, md, sliding_window=200, sinks=s, config=cfg), q, k, v, do, s, True)

    def ref(q, k, v, do, s, seg):
        return _fwd_and_grads(lambda q, k, v, s: attention_reference(
            q, k, v, segment_ids=seg, sliding_window=200, sinks=s), q, k, v, do, s, True)

    got = _gpu_compile(pallas, q, k, v, do, sinks, md)(q, k, v, do, sinks, md)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    want = _gpu_compile(ref, *f32, sinks, seg)(*f32, sinks, seg)
    for what, g, w in zip(["out", "dq", "dk", "dv", "dsinks"], got, want):
        _assert_close(g, w, 2e-2, what)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", GPU_TEST_SHAPES, ids=lambda s: s.name)
def test_gpu_cudnn_matches_reference(shape):
    q, k, v, _, _ = _inputs(shape.batch, shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim,
                            jnp.bfloat16)
    seg = jnp.asarray(make_segment_ids(shape)) if shape.layout == "packed" else None
    got = _gpu_compile(lambda q, k, v: dot_product_attention(
        q, k, v, segment_ids=seg, sliding_window=shape.window, implementation="cudnn"), q, k, v)(q, k, v)
    want = _gpu_compile(lambda q, k, v: attention_reference(
        q, k, v, segment_ids=seg, sliding_window=shape.window), q, k, v)(q, k, v)
    _assert_close(got, want, 2e-2, "cudnn")


def test_auto_policy_follows_the_measurements():
    from kernels_pallas.attention.config import choose_implementation

    def pick(t=8192, d=128, dtype=jnp.bfloat16, segments=False, backend="gpu", **kw):
        kw = dict(dict(causal=True, sliding_window=None, logit_softcap=None, sinks=None, scale=None), **kw)
        return choose_implementation((2, t, 32, d), (2, t, 8, d), dtype, segments, backend=backend, **kw)

    assert pick(backend="cpu") == "reference"
    assert pick() == "cudnn"  # dense causal: cuDNN measured fastest
    assert pick(t=30000, sliding_window=4096) == "cudnn"
    assert pick(segments=True) == "pallas"  # packed: Pallas measured fastest
    assert pick(sinks=jnp.zeros(32)) == "cudnn"  # dense rows: cuDNN with the sink correction (sinks.py)
    assert pick(sinks=jnp.zeros(32), segments=True) == "pallas"  # ... packed rows keep the Pallas kernel
    assert pick(logit_softcap=30.0) == "pallas"  # ... and soft-capping
    assert pick(dtype=jnp.float32) == "pallas"  # cuDNN flash needs 16-bit inputs
    assert pick(d=96) == "cudnn"  # no Pallas tiling for head_dim 96
    assert pick(d=96, sinks=jnp.zeros(32), segments=True) == "reference"
