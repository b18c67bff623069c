"""Every kernels_pallas op through the one dispatch helper (kernels_pallas/_dispatch.py).

Checks: each op's registry lists its implementations under the shared names; `supported_on` is False on
CPU for the GPU-only ones; an unknown name is one error line naming the op, the request and the choices;
None/"auto" resolves on CPU to something that runs and equals the reference; every implementation that
runs here (Pallas in interpret mode) agrees with the op's reference, values and gradients, on the op's
shared test shapes (the ones its bench.py imports); the tile tables apply the H200 entries only on an H200.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import attention, glu, linear_cross_entropy, rmsnorm
from kernels_pallas._dispatch import ALL_PLATFORMS, Implementation, Op
from kernels_pallas.attention import config as attn_config
from kernels_pallas.attention import shapes as attn_shapes
from kernels_pallas.glu import shapes as glu_shapes
from kernels_pallas.linear_cross_entropy import config as lce_config
from kernels_pallas.linear_cross_entropy import shapes as lce_shapes
from kernels_pallas.rmsnorm import shapes as norm_shapes

CPU = jax.devices("cpu")[0]
OPS = {"attention": attention.OP, "rmsnorm": rmsnorm.OP, "rmsnorm_offset": rmsnorm.OFFSET_OP, "swiglu": glu.OP,
       "geglu_tanh": glu.GEGLU_OP,
       "linear_cross_entropy": linear_cross_entropy.OP}
EXPECTED = {"attention": ("reference", "pallas", "cudnn"), "rmsnorm": ("reference", "xla"),
            "rmsnorm_offset": ("reference", "xla"), "swiglu": ("reference", "xla"),
            "geglu_tanh": ("reference", "xla"), "linear_cross_entropy": ("reference", "xla")}
TOL = {"float32": 2e-5, "bfloat16": 2e-2}


def _close(got, want, rel, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    assert err <= rel * scale, f"{what}: max |err| {err:.3g} > {rel} * {scale:.3g}"


# ---------------------------------------------------------------------------
# The registries.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("op", list(OPS))
def test_each_op_lists_its_implementations(op):
    reg = OPS[op]
    assert reg.name == op and reg.names == EXPECTED[op]
    assert all(isinstance(reg.get(n), Implementation) and callable(reg.get(n).fn) for n in reg.names)
    assert "reference" in reg.names  # every op has its definition as an implementation


@pytest.mark.parametrize("op", list(OPS))
def test_supported_on_cpu_excludes_gpu_only_implementations(op):
    reg = OPS[op]
    gpu_only = {"pallas", "cudnn"}
    for name in reg.names:
        assert reg.supported_on(name, CPU) == (name not in gpu_only), name
        assert reg.supported_on(name, "gpu"), name  # everything registered runs natively on a GPU
    assert reg.available_on(CPU) == tuple(n for n in reg.names if n not in gpu_only)


def test_pallas_runs_in_interpret_mode_on_cpu_but_cudnn_does_not():
    assert attention.OP.get("pallas").runs_on(CPU) and not attention.OP.get("pallas").supported_on(CPU)
    assert not attention.OP.get("cudnn").runs_on(CPU)
    q = jnp.zeros((1, 16, 2, 64))
    k = jnp.zeros((1, 16, 1, 64))
    with pytest.raises(ValueError) as info:
        attention.dot_product_attention(q, k, k, implementation="cudnn")
    msg = str(info.value)
    assert "\n" not in msg and "attention/api.py" in msg and "'cudnn'" in msg and "'cpu'" in msg
    assert "'reference', 'pallas'" in msg


def _unknown_calls():
    x = jnp.ones((2, 8))
    q, k = jnp.zeros((1, 16, 2, 64)), jnp.zeros((1, 16, 1, 64))
    hidden, weight = jnp.ones((4, 8)), jnp.ones((8, 10))
    targets, weights = jnp.zeros((4,), jnp.int32), jnp.ones((4,))
    return {
        "attention": lambda impl: attention.dot_product_attention(q, k, k, implementation=impl),
        "rmsnorm": lambda impl: rmsnorm.rmsnorm(x, jnp.ones((8,)), 1e-6, implementation=impl),
        "rmsnorm_offset": lambda impl: rmsnorm.rmsnorm(x, jnp.ones((8,)), 1e-6, implementation=impl, offset=True),
        "swiglu": lambda impl: glu.swiglu(x, x, implementation=impl),
        "geglu_tanh": lambda impl: glu.geglu_tanh(x, x, implementation=impl),
        "linear_cross_entropy": lambda impl: linear_cross_entropy.linear_cross_entropy(
            hidden, weight, targets, weights, implementation=impl),
    }


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("bad", ["triton", "pallas_mosaic", "XLA"])
def test_unknown_implementation_is_one_line_naming_the_choices(op, bad):
    with pytest.raises(ValueError) as info:
        _unknown_calls()[op](bad)
    msg = str(info.value)
    assert "\n" not in msg
    folder = {"swiglu": "glu", "geglu_tanh": "glu", "rmsnorm_offset": "rmsnorm"}.get(op, op)
    assert f"kernels_pallas/{folder}/api.py" in msg
    assert f"{op} has no implementation={bad!r}" in msg
    for name in OPS[op].accepted:
        assert repr(name) in msg


@pytest.mark.parametrize("op", list(OPS))
def test_auto_resolves_on_cpu_to_a_runnable_implementation(op):
    reg = OPS[op]
    for request in (None, "auto"):
        impl = reg.resolve(request, CPU)
        assert impl.supported_on(CPU) and impl.name == ("reference" if op == "attention" else "xla")
    # ... and the public function runs with it and equals the reference.
    if op == "attention":
        shape = attn_shapes.TEST_SHAPES[0]
        q, k, v, _ = _attn_inputs(shape)
        for request in (None, "auto"):
            _close(attention.dot_product_attention(q, k, v, implementation=request),
                   attention.attention_reference(q, k, v), 2e-5, op)
    elif op == "rmsnorm":
        x, w, _ = norm_shapes.make_inputs(norm_shapes.TEST_SHAPES[0])
        _close(rmsnorm.rmsnorm(x, w, 1e-6, implementation=None), rmsnorm.rmsnorm_reference(x, w, 1e-6), 2e-6, op)
    elif op == "swiglu":
        g, u, _ = glu_shapes.make_inputs(glu_shapes.TEST_SHAPES[0])
        _close(glu.swiglu(g, u, implementation=None), glu.swiglu_reference(g, u), 2e-6, op)
    else:
        args = lce_shapes.make_test_problem(lce_shapes.TEST_SHAPES[0])
        _close(linear_cross_entropy.linear_cross_entropy(*args, implementation=None),
               linear_cross_entropy.linear_cross_entropy_reference(*args), 1e-5, op)


def test_attention_xla_is_an_alias_of_the_reference():
    """"xla" meant the reference in attention; TrainConfig.attention_implementation still accepts it. Through the
    dispatch (either name) the reference gets the segments and the window: the reference's own definition with
    them (the Pallas kernel against it, values and gradients: test_attention_implementations_match_the_reference)."""
    assert attention.OP.resolve("xla", CPU).name == "reference"
    shape = attn_shapes.TEST_SHAPES[1]
    q, k, v, _ = _attn_inputs(shape)
    seg = jnp.asarray(attn_shapes.make_segment_ids(shape, seed=1, pad_tail=7))
    kw = dict(causal=True, sliding_window=attn_shapes.TEST_SHAPES[2].window, segment_ids=seg)
    want = attention.attention_reference(q, k, v, **kw)
    assert float(jnp.max(jnp.abs(want - attention.attention_reference(q, k, v)))) > 1e-2  # the kwargs matter
    for name in ("xla", "reference"):
        np.testing.assert_array_equal(attention.dot_product_attention(q, k, v, implementation=name, **kw), want)


def test_op_registry_rejects_inconsistent_definitions():
    ref = Implementation("reference", lambda x: x, ALL_PLATFORMS)
    with pytest.raises(ValueError, match="duplicate or reserved"):
        Op("o", "f.py", (ref, ref), ("reference",))
    with pytest.raises(ValueError, match="unknown implementation 'xla'"):
        Op("o", "f.py", (ref,), ("xla",))
    with pytest.raises(ValueError, match="unknown implementation 'pallas'"):
        Op("o", "f.py", (ref,), ("reference",), aliases={"old": "pallas"})
    gpu_only = Op("o", "f.py", (Implementation("cudnn", lambda x: x, ("gpu",)),), ("cudnn",))
    with pytest.raises(ValueError, match="no implementation for platform 'cpu'"):
        gpu_only.resolve(None, CPU)


# ---------------------------------------------------------------------------
# Every implementation that runs here vs the op's reference, on the shared shapes.
# ---------------------------------------------------------------------------
def _runnable(reg):
    return [n for n in reg.names if reg.get(n).runs_on(CPU)]


def _jit_vjp(fn, cotangent, *args):
    """(output, *input gradients) of `fn` as one program (op by op, every eager op of a new shape compiles on
    its own)."""
    return jax.jit(lambda c, *a: (lambda out, pull: (out, *pull(c)))(*jax.vjp(fn, *a)))(cotangent, *args)


@pytest.mark.parametrize("shape", norm_shapes.TEST_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("impl", _runnable(rmsnorm.OP))
def test_rmsnorm_implementations_match_the_reference(impl, shape):
    x, w, dy = norm_shapes.make_inputs(shape)
    got, *got_grads = _jit_vjp(lambda x, w: rmsnorm.rmsnorm(x, w, 1e-6, implementation=impl), dy, x, w)
    want, *want_grads = _jit_vjp(lambda x, w: rmsnorm.rmsnorm_reference(x, w, 1e-6), dy, x, w)
    tol = {"float32": 2e-6, "bfloat16": 2e-2}[shape.dtype]
    _close(got, want, tol, "y")
    for name, g, r in zip(("dx", "dw"), got_grads, want_grads):
        assert g.dtype == r.dtype
        _close(g, r, tol, name)


@pytest.mark.parametrize("shape", glu_shapes.TEST_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("impl", _runnable(glu.OP))
def test_swiglu_implementations_match_the_reference(impl, shape):
    g, u, dh = glu_shapes.make_inputs(shape)
    got, *got_grads = _jit_vjp(lambda g, u: glu.swiglu(g, u, implementation=impl), dh, g, u)
    want, *want_grads = _jit_vjp(glu.swiglu_reference, dh, g, u)
    tol = {"float32": 2e-6, "bfloat16": 2e-2}[shape.dtype]
    _close(got, want, tol, "h")
    for name, a, b in zip(("dgate", "dup"), got_grads, want_grads):
        assert a.dtype == b.dtype
        _close(a, b, tol, name)


@pytest.mark.parametrize("shape", lce_shapes.TEST_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("impl", _runnable(linear_cross_entropy.OP))
def test_linear_cross_entropy_implementations_match_the_reference(impl, shape):
    args = lce_shapes.make_test_problem(shape)
    cap = shape.logit_softcap

    def vg(fn):
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 3)))(*args)

    got = vg(lambda h, w, t, m: linear_cross_entropy.linear_cross_entropy(
        h, w, t, m, logit_softcap=cap, chunk_size=16, implementation=impl))
    want = vg(lambda h, w, t, m: linear_cross_entropy.linear_cross_entropy_reference(h, w, t, m, logit_softcap=cap))
    _close(got[0], want[0], 1e-5, "loss")
    for name, g, r in zip(("dhidden", "dweight", "dweights"), got[1], want[1]):
        assert g.dtype == r.dtype
        _close(g, r, TOL[shape.dtype] if shape.dtype == "bfloat16" else 1e-5, name)


@jax.jit(static_argnums=(0, 1))
def _attn_inputs(shape, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    b, t, h, kvh, d = shape.batch, shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim
    dims = [(b, t, h, d), (b, t, kvh, d), (b, t, kvh, d), (b, t, h, d)]
    return [jax.random.normal(key, s, jnp.float32) for key, s in zip(ks, dims)]


# The reference through the dispatch is the reference itself (test_attention_xla_is_an_alias_of_the_reference).
@pytest.mark.parametrize("shape", attn_shapes.TEST_SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("impl", [n for n in _runnable(attention.OP) if n != "reference"])
def test_attention_implementations_match_the_reference(impl, shape):
    q, k, v, do = _attn_inputs(shape)
    seg = jnp.asarray(attn_shapes.make_segment_ids(shape, seed=1, pad_tail=7 if shape.layout == "packed" else 0))
    kw = dict(causal=True, sliding_window=shape.window)
    seg_arg = seg if shape.layout == "packed" else None
    # The metadata built inside the program (jittable; eager it compiles each of its ops on its own).
    got = _jit_vjp(lambda q, k, v: attention.dot_product_attention(
        q, k, v, segment_ids=seg_arg, metadata=attention.make_metadata(seg, block_q=64, block_k=64, **kw),
        implementation=impl, **kw), do, q, k, v)
    want = _jit_vjp(lambda q, k, v: attention.attention_reference(q, k, v, segment_ids=seg_arg, **kw), do, q, k, v)
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, want):
        _close(g, r, 2e-5, name)


# ---------------------------------------------------------------------------
# Tile tables keyed by device kind.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim", attn_config.HEAD_DIMS)
def test_attention_h200_tiles_only_on_an_h200(head_dim):
    assert attn_config.tiles_for("NVIDIA H200", head_dim) == attn_config.H200_TILES[head_dim]
    for other in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090", "cpu"):
        assert attn_config.tiles_for(other, head_dim) == attn_config.CONSERVATIVE_TILES[head_dim], other
    # The default (no config given) follows the device the program runs on: CPU here.
    assert attn_config.default_flash_config(head_dim) == attn_config.CONSERVATIVE_TILES[head_dim]
    # The two tables differ where measured (head_dim 128), so the lookup is not vacuous.
    assert attn_config.H200_TILES[128] != attn_config.CONSERVATIVE_TILES[128]


def test_attention_tiles_reject_unsupported_head_dims():
    with pytest.raises(ValueError, match=r"head_dim=96 .*use one of \(64, 128, 256\)"):
        attn_config.tiles_for("NVIDIA H200", 96)


def test_linear_cross_entropy_chunks_follow_the_device_kind():
    n, vocab = 16384, 128256
    assert lce_config.tiles_for("NVIDIA H200", n, vocab) == 512  # 256 MiB measured budget
    assert lce_config.tiles_for("NVIDIA H100 80GB HBM3", n, vocab) == 512  # the H200's
    assert lce_config.tiles_for("NVIDIA A100-SXM4-80GB", n, vocab) == 128  # 64 MiB conservative
    assert lce_config.config_for("cpu") == lce_config.CONSERVATIVE_CONFIG
    # The default chunk of linear_cross_entropy is the current device's (CPU: conservative): 4096 tokens of a
    # 32000 vocabulary go in 512-token chunks (8 scanned chunks); on an H200 they would be 2048 (2 chunks).
    hidden = jax.ShapeDtypeStruct((4096, 16), jnp.float32)
    weight = jax.ShapeDtypeStruct((16, 32000), jnp.float32)
    targets, weights = jax.ShapeDtypeStruct((4096,), jnp.int32), jax.ShapeDtypeStruct((4096,), jnp.float32)
    jaxpr = jax.make_jaxpr(linear_cross_entropy.linear_cross_entropy)(hidden, weight, targets, weights)
    scans = [e.params["length"] for e in linear_cross_entropy.iter_eqns(jaxpr.jaxpr) if e.primitive.name == "scan"]
    assert scans == [4096 // lce_config.tiles_for("cpu", 4096, 32000)] == [8]
