"""Numerics of kernels_pallas.linear_cross_entropy.

Oracle chain: torch.nn.functional.cross_entropy (fp32, CPU) checks the naive
JAX reference; the chunked xla implementation is checked against both, for
values and for gradients w.r.t. hidden, weight and the per-token weights.
"""

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from kernels_pallas.linear_cross_entropy import (
    DEFAULT_CONFIG,
    LinearCrossEntropyConfig,
    config_for,
    default_chunk_size,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    tiles_for,
    transposed_copies,
)
from kernels_pallas.linear_cross_entropy.config import CONSERVATIVE_CONFIG, H200_CONFIG
from kernels_pallas.linear_cross_entropy.shapes import GPU_TEST_SHAPES, make_test_problem

IGNORE = -100  # HF ignore id: must be harmless wherever the weight is 0.


def _problem(n, h, v, *, seed=0, ignore_frac=0.25, dtype=np.float32):
    """Random inputs; ignored tokens get weight 0 and target -100."""
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((n, h)).astype(np.float32)
    # Scale so logits are O(few): soft-caps at 2-3 then bend them noticeably.
    weight = (rng.standard_normal((h, v)) * 1.5 / np.sqrt(h)).astype(np.float32)
    targets = rng.integers(0, v, size=n).astype(np.int32)
    weights = rng.uniform(0.5, 2.0, size=n).astype(np.float32)
    ignored = rng.random(n) < ignore_frac
    ignored[0] = True  # at least one ignored token in every problem
    weights[ignored] = 0.0
    targets[ignored] = IGNORE
    return (
        jnp.asarray(hidden, dtype),
        jnp.asarray(weight, dtype),
        jnp.asarray(targets),
        jnp.asarray(weights),
    )


def _torch_loss_and_grads(hidden, weight, targets, weights, softcap):
    """fp32 torch oracle: value and grads w.r.t. hidden, weight and weights."""
    th = torch.tensor(np.asarray(hidden, np.float32), requires_grad=True)
    tw = torch.tensor(np.asarray(weight, np.float32), requires_grad=True)
    tm = torch.tensor(np.asarray(weights, np.float32), requires_grad=True)
    logits = th @ tw
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    ce = torch.nn.functional.cross_entropy(
        logits, torch.tensor(np.asarray(targets, np.int64)),
        ignore_index=IGNORE, reduction="none",
    )
    loss = (tm * ce).sum()
    loss.backward()
    return (
        loss.detach().numpy(),
        (th.grad.numpy(), tw.grad.numpy(), tm.grad.numpy()),
    )


def _raw_value_and_grads(fn, hidden, weight, targets, weights):
    vg = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 3)))
    return vg(hidden, weight, targets, weights)


def _value_and_grads(fn, hidden, weight, targets, weights):
    value, grads = _raw_value_and_grads(fn, hidden, weight, targets, weights)
    return np.asarray(value), tuple(np.asarray(g, np.float32) for g in grads)


def _close(actual, expected, rtol, what):
    expected = np.asarray(expected, np.float32)
    atol = rtol * max(float(np.max(np.abs(expected))), 1e-6)
    np.testing.assert_allclose(np.asarray(actual, np.float32), expected,
                               rtol=rtol, atol=atol, err_msg=what)


def _xla(chunk, softcap):
    return lambda h, w, t, m: linear_cross_entropy(
        h, w, t, m, chunk_size=chunk, logit_softcap=softcap
    )


def _ref(softcap):
    return lambda h, w, t, m: linear_cross_entropy_reference(
        h, w, t, m, logit_softcap=softcap
    )


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_reference_matches_torch(softcap):
    args = _problem(53, 24, 211, seed=1)
    value, grads = _value_and_grads(_ref(softcap), *args)
    t_value, t_grads = _torch_loss_and_grads(*args, softcap)
    _close(value, t_value, 1e-5, "loss")
    for name, g, tg in zip(("dhidden", "dweight", "dweights"), grads, t_grads):
        # torch gives d/dweights = 0 at ignored tokens (CE is masked there);
        # ours is CE of the clipped target, which is irrelevant for 0/1 masks.
        if name == "dweights":
            keep = np.asarray(args[3]) != 0
            g, tg = g[keep], tg[keep]
        _close(g, tg, 1e-5, name)


@pytest.mark.parametrize(
    "n,chunk,softcap",
    [
        (64, 16, None),    # chunk divides N: scan only
        (67, 16, 2.5),     # remainder of 3 tokens after the scan, soft-capped
        (67, 32, 3.0),     # two scanned chunks -> single-chunk path + tail
        (67, None, None),  # default chunk: the whole problem in one chunk
        (5, 16, 2.5),      # chunk larger than N
        (23, 1, None),     # one token per chunk
    ],
)
def test_xla_matches_reference_fp32(n, chunk, softcap):
    args = _problem(n, 32, 301, seed=n)
    value, grads = _value_and_grads(_xla(chunk, softcap), *args)
    r_value, r_grads = _value_and_grads(_ref(softcap), *args)
    _close(value, r_value, 1e-5, "loss")
    for name, g, rg in zip(("dhidden", "dweight", "dweights"), grads, r_grads):
        _close(g, rg, 1e-5, name)


# Without the soft-cap: the reference against torch (test_reference_matches_torch), xla against the reference.
@pytest.mark.parametrize("softcap", [2.5])
def test_xla_matches_torch(softcap):
    args = _problem(70, 16, 257, seed=7)
    value, grads = _value_and_grads(_xla(24, softcap), *args)
    t_value, t_grads = _torch_loss_and_grads(*args, softcap)
    _close(value, t_value, 1e-5, "loss")
    _close(grads[0], t_grads[0], 1e-5, "dhidden")
    _close(grads[1], t_grads[1], 1e-5, "dweight")


# The soft-cap's code is the same in either dtype (the fp32 cases: test_xla_matches_reference_fp32).
@pytest.mark.parametrize("softcap", [2.5])
def test_xla_bf16_inputs(softcap):
    args = _problem(67, 32, 301, seed=3, dtype=jnp.bfloat16)
    fn = _xla(16, softcap)
    loss, (dh, dw, dm) = _raw_value_and_grads(fn, *args)
    assert loss.dtype == jnp.float32
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    assert dm.dtype == jnp.float32
    value = np.asarray(loss)
    grads = tuple(np.asarray(g, np.float32) for g in (dh, dw, dm))
    r_value, r_grads = _value_and_grads(_ref(softcap), *args)
    # Same bf16 operands and fp32 accumulation: the value matches tightly.
    _close(value, r_value, 1e-5, "loss")
    # dlogits are rounded to bf16 before the backward matmuls (as in any
    # bf16 training step), so gradients agree to bf16 precision.
    for name, g, rg in zip(("dhidden", "dweight", "dweights"), grads, r_grads):
        _close(g, rg, 2e-2, name)
    # bf16 vs the fp32 torch oracle on the same (bf16-representable) numbers.
    t_value, _ = _torch_loss_and_grads(*args, softcap)
    _close(value, t_value, 1e-4, "loss vs torch")


@pytest.mark.parametrize("impl,chunk,softcap", [("xla", 16, 2.5), ("xla", 32, None), ("reference", None, 2.5)])
def test_vocab_major_weight_equals_transposed(impl, chunk, softcap):
    # A tied head passes the [V, H] embedding table as it is (weight_layout="vh"): the same loss and
    # gradients as its [H, V] transpose, and d weight comes back [V, H].
    hidden, weight, targets, weights = _problem(67, 32, 301, seed=4)
    table = jnp.asarray(np.ascontiguousarray(np.asarray(weight).T))

    def fn(layout):
        return lambda h, w, t, m: linear_cross_entropy(h, w, t, m, chunk_size=chunk, logit_softcap=softcap,
                                                       implementation=impl, weight_layout=layout)

    value, grads = _value_and_grads(fn("vh"), hidden, table, targets, weights)
    want, want_grads = _value_and_grads(fn("hv"), hidden, weight, targets, weights)
    assert grads[1].shape == table.shape
    _close(value, want, 1e-6, "loss")
    for name, g, wg in zip(("dhidden", "dweight^T", "dweights"), (grads[0], grads[1].T, grads[2]), want_grads):
        _close(g, wg, 1e-6, name)


def test_vocab_major_weight_is_not_copied_transposed():
    # Why the layout exists: `embedding.T` fed to the chunk loop was materialised as a transposed copy of the
    # whole table (XLA does not fold a transpose into the loop's dots; 1.7 GiB for Gemma 2's table on the
    # H200 target), the same on CPU. weight_layout="vh" reads the table in place.
    n, h, v = 256, 64, 1000
    args = (jax.ShapeDtypeStruct((n, h), jnp.bfloat16), jax.ShapeDtypeStruct((v, h), jnp.bfloat16),
            jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.float32))

    def hlo(transposed: bool) -> str:
        def grad(hd, table, t, m):
            w, layout = (table.T, "hv") if transposed else (table, "vh")
            return jax.grad(lambda x: linear_cross_entropy(x, w, t, m, chunk_size=64, logit_softcap=30.0,
                                                           weight_layout=layout))(hd)
        return jax.jit(grad).lower(*args).compile().as_text()

    assert transposed_copies(hlo(True), (v, h)), "the check no longer sees the transposed copy it guards against"
    assert transposed_copies(hlo(False), (v, h)) == []


def test_ignored_tokens_do_not_contribute():
    hidden, weight, targets, weights = _problem(40, 16, 97, seed=5, ignore_frac=0.5)
    keep = np.asarray(weights) != 0
    fn = jax.jit(_xla(8, 2.5))
    full = fn(hidden, weight, targets, weights)
    kept = fn(hidden[keep], weight, targets[keep], weights[keep])
    _close(full, kept, 1e-5, "loss with ignored tokens removed")
    dh = jax.jit(jax.grad(_xla(8, 2.5)))(hidden, weight, targets, weights)
    assert np.all(np.asarray(dh)[~keep] == 0.0)
    assert np.all(np.isfinite(np.asarray(dh)))


def test_all_tokens_ignored_gives_zero():
    hidden, weight, targets, _ = _problem(19, 16, 50, seed=2)
    zeros = jnp.zeros((19,), jnp.float32)
    value, (dh, dw, dm) = _value_and_grads(_xla(8, None), hidden, weight, targets, zeros)
    assert value == 0.0
    assert not np.any(dh) and not np.any(dw)
    assert np.all(np.isfinite(dm))


def test_grad_of_weights_only_and_mean_loss():
    args = _problem(45, 16, 80, seed=9)
    hidden, weight, targets, weights = args

    def mean_loss(fn, m):
        return fn(hidden, weight, targets, m) / jnp.sum(m)

    g = jax.jit(jax.grad(lambda m: mean_loss(_xla(8, None), m)))(weights)
    rg = jax.jit(jax.grad(lambda m: mean_loss(_ref(None), m)))(weights)
    _close(g, rg, 1e-5, "d mean-loss / d weights")


def test_default_chunk_size():
    # 256 MiB of fp32 logits per chunk, rounded down to a multiple of 128.
    assert default_chunk_size(16384, 128256) == 512
    assert default_chunk_size(16384, 151936) == 384
    assert default_chunk_size(16384, 32000) == 2048
    assert default_chunk_size(100, 32000) == 100  # capped at N
    for v in (128256, 151936, 32000, 256000):
        c = default_chunk_size(1 << 20, v)
        assert c * v * 4 <= DEFAULT_CONFIG.logits_chunk_bytes
        assert c % DEFAULT_CONFIG.chunk_multiple == 0
    # A budget below one multiple's block: one multiple (one matmul tile of rows), not a narrower chunk.
    tiny = LinearCrossEntropyConfig(logits_chunk_bytes=4 * 1000 * 50)
    assert default_chunk_size(10_000, 1000, tiny) == 128
    assert default_chunk_size(10_000, 10**9, tiny) == 128
    assert default_chunk_size(100, 10**9, tiny) == 100  # still at most N
    # GPT-OSS-20B's vocabulary under the conservative budget: 128, where the budget alone gives 83 tokens.
    assert CONSERVATIVE_CONFIG.logits_chunk_bytes // (201088 * 4) == 83
    assert default_chunk_size(16384, 201088, CONSERVATIVE_CONFIG) == 128


def test_the_hopper_parts_take_the_measured_budget():
    assert config_for("NVIDIA H200") is config_for("NVIDIA H100 80GB HBM3") is H200_CONFIG
    assert config_for("NVIDIA A100-SXM4-40GB") is config_for("cpu") is CONSERVATIVE_CONFIG
    assert tiles_for("NVIDIA H100 80GB HBM3", 16384, 201088) == tiles_for("NVIDIA H200", 16384, 201088) == 256


@pytest.mark.parametrize(
    "kwargs", [{"logits_chunk_bytes": 0}, {"chunk_multiple": -1}, {"chunk_multiple": 1.5}]
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError, match="config.py"):
        LinearCrossEntropyConfig(**kwargs)


def _bad_inputs():
    h = jnp.zeros((6, 4), jnp.float32)
    w = jnp.zeros((4, 10), jnp.float32)
    t = jnp.zeros((6,), jnp.int32)
    m = jnp.ones((6,), jnp.float32)
    return [
        ((h[None], w, t, m), {}, "flatten batch"),
        ((h, w.T, t, m), {}, "weight_layout='vh'"),
        ((h, w, t, m), {"weight_layout": "vh"}, "weight_layout='hv'"),
        ((h, w, t, m), {"weight_layout": "v,h"}, "weight_layout must be"),
        ((h, w, t[:5], m), {}, "targets"),
        ((h, w, t.astype(jnp.float32), m), {}, "targets"),
        ((h, w, t, m[:5]), {}, "loss_mask"),
        ((h, w, t, m.astype(jnp.int32)), {}, "loss_mask"),
        ((h.astype(jnp.int32), w, t, m), {}, "floating"),
        ((h, w, t, m), {"logit_softcap": -1.0}, "logit_softcap"),
        ((h, w, t, m), {"logit_softcap": jnp.float32(3.0)}, "traced"),
        ((h, w, t, m), {"chunk_size": 0}, "chunk_size"),
        ((h, w, t, m), {"implementation": "triton"}, "implementation"),
    ]


@pytest.mark.parametrize("args,kwargs,hint", _bad_inputs())
def test_bad_inputs_raise_with_hint(args, kwargs, hint):
    with pytest.raises(ValueError, match="api.py") as info:
        linear_cross_entropy(*args, **kwargs)
    assert hint in str(info.value)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_TEST_SHAPES, ids=lambda s: s.name)
def test_gpu_xla_matches_reference(shape):
    # A realistic head on the GPU: several chunks plus a remainder.  Compiled without XLA's GEMM
    # autotuning, which took 12-23 s per program here on the H200 (measured) and does not change the math.
    args = make_test_problem(shape, seed=11)

    def compiled(fn):
        vg = jax.value_and_grad(fn, argnums=(0, 1, 3))
        return jax.jit(vg).lower(*args).compile(compiler_options={"xla_gpu_autotune_level": 0})

    value, grads = compiled(_xla(384, shape.logit_softcap))(*args)
    r_value, r_grads = compiled(_ref(shape.logit_softcap))(*args)
    rtol = 1e-4 if shape.dtype == "float32" else 2e-2
    _close(value, r_value, 1e-4, "loss")
    for name, g, rg in zip(("dhidden", "dweight", "dweights"), grads, r_grads):
        _close(g, rg, rtol, name)


@pytest.mark.parametrize("dtype,rtol,argnums,softcap", [  # each pair of dtype, argnums and soft-cap once
    (np.float32, 1e-5, (0,), None), (np.float32, 1e-5, (0, 3), 2.5),
    (jnp.bfloat16, 2e-2, (0,), 2.5), (jnp.bfloat16, 2e-2, (0, 3), None)])
def test_frozen_head_eager_gradient_matches_reference(softcap, argnums, dtype, rtol):
    """Weight frozen (the LoRA case): dhidden comes from the forward pass's unit gradient, scaled by g."""
    args = _problem(77, 24, 211, seed=5, dtype=dtype)

    def outer(fn):  # a non-unit cotangent g, so that the scaling by g is exercised
        return lambda *a: 3.0 * fn(*a)

    got = jax.jit(jax.value_and_grad(outer(_xla(16, softcap)), argnums=argnums))(*args)
    want = jax.jit(jax.value_and_grad(outer(_ref(softcap)), argnums=argnums))(*args)
    _close(got[0], want[0], 1e-5, "loss")
    for g, w, i in zip(got[1], want[1], argnums):
        assert g.dtype == args[i].dtype
        _close(g, w, rtol, f"grad of arg {i}")


def test_frozen_head_backward_has_no_matmul():
    """With the head frozen the backward pass only scales U: every dot_general of the gradient program
    sits in the forward chunk loop (logits + unit gradient), none after it."""
    args = _problem(64, 16, 97, seed=6)
    jaxpr = jax.make_jaxpr(jax.grad(_xla(16, None), argnums=0))(*args).jaxpr

    def dots(jx):
        n = 0
        for eqn in jx.eqns:
            n += eqn.primitive.name == "dot_general"
            for v in eqn.params.values():
                for sub in v if isinstance(v, (list, tuple)) else [v]:
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        n += dots(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        n += dots(sub)
        return n

    assert dots(jaxpr) == 2
