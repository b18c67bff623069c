"""`jaxft.memory.scan_offload.offloaded_scan`: the gradients of the plain scan (carry, the differentiated scanned
inputs, through a closed-over constant and a tuple carry with a small accumulator), nothing for what the caller does not
differentiate, and, lowered for a GPU, each carry goes to pinned host and comes back once; the loops read their
stacks at indices affine in their counter (what XLA copies with)."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

from jaxft.memory.scan_offload import HostRows, in_host_memory, offloaded_scan
from lora_helpers import jaxpr_eqns

L, T, H = 5, 16, 8


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    lora = jnp.asarray(rng.standard_normal((L, H, H)) / H ** 0.5, jnp.float32)
    frozen = jnp.asarray(rng.standard_normal((L, H, H)) / H ** 0.5, jnp.float32)
    table = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)  # closed over, like the RoPE tables
    return x, lora, frozen, table


def _layer(table):
    def f(carry, xs):
        x, acc = carry
        lora, frozen, index = xs
        y = jnp.tanh(x @ frozen + (x * table) @ lora) + x * (1.0 + 0.1 * index)
        return y, acc + jnp.stack([jnp.sum(y), jnp.sum(y * y)])
    return f


def _loss(scan):
    def loss(x, lora, frozen, table):
        carry = (x, jnp.zeros((2,), jnp.float32))
        y, acc = scan(_layer(table), carry, (lora, frozen, jnp.arange(L, dtype=jnp.int32)))
        return jnp.sum(jnp.sin(y)) + 0.01 * jnp.sum(acc)
    return loss


def _close(got, want) -> None:
    """Equal to fp32 rounding: XLA may contract or order a sum differently in the two programs (the CPU code at -O0,
    tests/conftest.py), so the absolute slack scales with the array's largest value."""
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(want).max())))


def _plain(f, carry, xs):
    return jax.lax.scan(lambda c, x: (f(c, x), None), carry, xs)[0]


def test_gradients_equal_the_plain_scan():
    args = _inputs()
    want = jax.jit(jax.value_and_grad(_loss(_plain), argnums=(0, 1)))(*args)
    got = jax.jit(jax.value_and_grad(_loss(offloaded_scan), argnums=(0, 1)))(*args)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for g, w in zip(got[1], want[1]):
        _close(g, w)


def test_only_what_the_caller_differentiates_is_differentiated():
    """The frozen weights' cotangent is never formed: the compiled gradient in the LoRA stack alone has no
    [L, H, H] product of the frozen stack's transpose (counted as dots against the input's cotangent)."""
    args = _inputs(1)
    g_lora = jax.jit(jax.grad(_loss(offloaded_scan), argnums=1))(*args)
    want = jax.jit(jax.grad(_loss(_plain), argnums=1))(*args)
    _close(g_lora, want)
    both = jax.jit(jax.grad(_loss(offloaded_scan), argnums=(1, 2))).lower(*args).as_text().count("dot_general")
    lora_only = jax.jit(jax.grad(_loss(offloaded_scan), argnums=1)).lower(*args).as_text().count("dot_general")
    assert lora_only < both


def test_lowered_for_a_gpu_each_carry_goes_to_the_host_and_back():
    """Two placements to pinned host (the layer input, not the [2] accumulator: in the forward loop's body and in
    the last iteration after it) and two back to the device: the last iteration's carry before the backward loop,
    and the prefetch inside its body."""
    args = _inputs(2)
    grad = jax.jit(jax.grad(_loss(offloaded_scan), argnums=1))
    text = grad.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count('_xla_buffer_placement = "pinned_host"') == 2
    assert text.count('_xla_buffer_placement = "device"') == 2


def test_a_period_of_several_layers_equals_the_plain_scan():
    """Two functions per iteration (a periodic stack's period): each one's input waits on the host."""
    x, lora, frozen, table = _inputs(3)
    f, g = _layer(table), _layer(table * 0.5)

    def loss(scan, x, lora):
        carry = (x, jnp.zeros((2,), jnp.float32))
        xs = (lora, frozen, jnp.arange(L, dtype=jnp.int32))
        y, acc = scan([f, g], carry, xs)
        return jnp.sum(jnp.sin(y)) + 0.01 * jnp.sum(acc)

    def plain(fs, carry, xs):
        return jax.lax.scan(lambda c, x: (fs[1](fs[0](c, x), x), None), carry, xs)[0]

    want = jax.grad(lambda *a: loss(plain, *a), argnums=(0, 1))(x, lora)
    got = jax.grad(lambda *a: loss(offloaded_scan, *a), argnums=(0, 1))(x, lora)
    for a, b in zip(got, want):  # float32 rounding of gradients up to ~40 (the loop and the last layer fuse apart)
        # three layers a period, each differentiated twice over: fp32 orders of the two programs drift further
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))
    text = jax.jit(jax.grad(lambda *a: loss(offloaded_scan, *a), argnums=1)).trace(x, lora).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count('_xla_buffer_placement = "pinned_host"') == 4  # each f's input: in the loop, and the last


def _on_host(x):
    """`x` in pinned host memory (what `frozen_weights: host` does to the layers' frozen weights)."""
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))


def _streamed_loss(scan, frozen_xs, **kw):
    def loss(x, lora, table):
        carry = (x, jnp.zeros((2,), jnp.float32))
        y, acc = scan(_layer(table), carry, (lora, frozen_xs, jnp.arange(L, dtype=jnp.int32)), **kw)
        return jnp.sum(jnp.sin(y)) + 0.01 * jnp.sum(acc)
    return loss


def test_streamed_weights_give_the_gradients_of_the_plain_scan():
    """Frozen weights in pinned host memory, read through `HostRows` (here from row 2 of a taller stack, as a
    group of layers after others reads its rows), with the carries on the host or on the device: the gradients
    of the plain scan over the weights on the device."""
    x, lora, frozen, table = _inputs(4)
    taller = jnp.concatenate([frozen[:2] * 3.0, frozen], axis=0)
    host = _on_host(taller)
    assert in_host_memory(host) and not in_host_memory(frozen)
    want = jax.jit(jax.value_and_grad(_streamed_loss(_plain, frozen), argnums=(0, 1)))(x, lora, table)
    for keep_on_host in (True, False):
        got = jax.jit(jax.value_and_grad(_streamed_loss(offloaded_scan, HostRows(host, 2), host=keep_on_host),
                                         argnums=(0, 1)))(x, lora, table)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
        for g, w in zip(got[1], want[1]):
            _close(g, w)
    value = jax.jit(_streamed_loss(offloaded_scan, HostRows(host, 2)))(x, lora, table)  # the primal alone
    np.testing.assert_allclose(value, want[0], rtol=1e-6)


def test_streamed_blocks_of_rows_feed_a_period():
    """`HostRows(size=2)`: iteration i reads rows 2i, 2i + 1 (a period of two layers), as the plain scan over the
    [L/2, 2, ...] reshaped stack does."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    frozen = jnp.asarray(rng.standard_normal((2 * L, H, H)) / H ** 0.5, jnp.float32)
    lora = jnp.asarray(rng.standard_normal((L, H)), jnp.float32)

    def f(c, xs):
        scale, w, _ = xs
        return jnp.tanh(jnp.tanh(c @ w[0]) @ w[1]) * scale + c

    def loss(scan, w, x, lora):
        return jnp.sum(jnp.sin(scan(f, x, (lora, w, jnp.arange(L, dtype=jnp.int32)))))

    want = jax.grad(lambda *a: loss(_plain, frozen.reshape(L, 2, H, H), *a), argnums=(0, 1))(x, lora)
    got = jax.jit(jax.grad(lambda *a: loss(offloaded_scan, HostRows(_on_host(frozen), 0, 2), *a),
                           argnums=(0, 1)))(x, lora)
    for a, b in zip(got, want):
        _close(a, b)


def test_lowered_for_a_gpu_each_layers_weights_come_to_the_device_once_each_way():
    """The streamed stack's rows reach the device by placements only: in the forward the first layer's before
    the loop and one prefetch in its body; in the backward one prefetch in its body (its first layer's weights
    are the forward's last fetch). With the carries on the device, those are all the device placements, and
    nothing goes to the host; with them on the host, each goes there from the forward loop and from its last
    iteration, and comes back before the backward loop and in its body."""
    x, lora, frozen, table = _inputs(6)
    host = _on_host(frozen)
    for keep_on_host, to_host, to_device in ((False, 0, 3), (True, 2, 5)):
        grad = jax.jit(jax.grad(lambda lora, w: _streamed_loss(offloaded_scan, HostRows(w), host=keep_on_host)(
            x, lora, table)))  # the weights an argument: its placement in host memory is the program's
        text = grad.trace(lora, host).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count('_xla_buffer_placement = "pinned_host"') == to_host
        assert text.count('_xla_buffer_placement = "device"') == to_device


def test_differentiating_a_streamed_input_is_refused():
    x, lora, frozen, table = _inputs(7)

    def loss(w):
        return _streamed_loss(offloaded_scan, HostRows(w))(x, lora, table)

    with pytest.raises(ValueError, match="streamed input"):
        jax.grad(loss)(_on_host(frozen))


def _named_layer(table):
    """`_layer` with its matmul output named "h", what a policy may keep."""
    def f(carry, xs):
        x, acc = carry
        lora, frozen, index = xs
        h = checkpoint_name(x @ frozen + (x * table) @ lora, "h")
        y = jnp.tanh(h) + x * (1.0 + 0.1 * index)
        return y, acc + jnp.stack([jnp.sum(y), jnp.sum(y * y)])
    return f


def _named_loss(scan, table, weights, **kw):
    """The loss of `_named_layer`'s scan under `scan` (offloaded_scan with its options, or `_plain`)."""
    def f(x, lora):
        carry = (x, jnp.zeros((2,), jnp.float32))
        y, acc = scan(_named_layer(table), carry, (lora, weights, jnp.arange(L, dtype=jnp.int32)), **kw)
        return jnp.sum(jnp.sin(y)) + 0.01 * jnp.sum(acc)
    return f


def _assert_value_and_grads_match(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for g, w in zip(got[1], want[1]):
        _close(g, w)


@pytest.mark.parametrize("streamed", [False, True])
def test_a_policy_keeps_its_residuals_and_refetches_the_weights(streamed):
    """With `policy` the forward keeps what it saves ("h", a [T, H] per layer, stacked) and the backward does not
    recompute it; the gradients are the plain scan's. The weights and the carry are never among the stacked
    residuals (the weights are refetched or read from the scanned input, the carry is the scan's own copy): the
    residuals hold one [L - 1, T, H] stack (the loop's layers; the last layer's is kept apart) more than without
    the policy and no more [L - 1, H, H] or [L, H, H] ones."""
    x, lora, frozen, table = _inputs(8)
    policy = jax.checkpoint_policies.save_only_these_names("h")
    weights = HostRows(_on_host(frozen)) if streamed else frozen

    want = jax.value_and_grad(_named_loss(_plain, table, frozen), argnums=(0, 1))(x, lora)
    for host in (True, False):
        loss = _named_loss(offloaded_scan, table, weights, host=host, policy=policy)
        _assert_value_and_grads_match(jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, lora), want)

    def shapes(**kw):
        _, vjp = jax.vjp(_named_loss(offloaded_scan, table, weights, **kw), x, lora)
        leaves = [leaf.shape for leaf in jax.tree.leaves(vjp)]
        return leaves.count((L - 1, T, H)), leaves.count((L - 1, H, H)) + leaves.count((L, H, H))

    (stacks_none, weights_none), (stacks_kept, weights_kept) = shapes(), shapes(policy=policy)
    assert stacks_kept == stacks_none + 1 and weights_kept == weights_none


@pytest.mark.parametrize("streamed", [False, True])
def test_kept_residuals_on_the_host_give_the_same_gradients_and_go_there_once(streamed):
    """`residuals_host`: what the policy keeps ("h") waits in pinned host memory like the carries. Gradients are the
    plain scan's; lowered for a GPU, the forward moves "h" to the host once per layer (in the loop's body, and
    after it for the last layer) and the backward brings each layer's back once (the last layer's before the
    backward loop, the rest one layer ahead in its body), on top of the carries' placements."""
    x, lora, frozen, table = _inputs(9)
    policy = jax.checkpoint_policies.save_only_these_names("h")
    weights = HostRows(_on_host(frozen)) if streamed else frozen

    want = jax.value_and_grad(_named_loss(_plain, table, frozen), argnums=(0, 1))(x, lora)
    loss = _named_loss(offloaded_scan, table, weights, policy=policy, residuals_host=True)
    _assert_value_and_grads_match(jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, lora), want)

    def placements(**kw):
        loss = _named_loss(offloaded_scan, table, weights, policy=policy, **kw)
        text = jax.jit(jax.grad(loss, argnums=1)).trace(x, lora).lower(
            lowering_platforms=("cuda",)).as_text()
        return text.count('_xla_buffer_placement = "pinned_host"'), text.count('_xla_buffer_placement = "device"')

    (host_off, dev_off), (host_on, dev_on) = placements(), placements(residuals_host=True)
    assert (host_on - host_off, dev_on - dev_off) == (2, 2)


def _affine_in_counter(var, counter, defs) -> bool:
    """Whether `var` is the counter plus or minus literals, or literals minus it (through converts): an index XLA
    copies with."""
    while var is not counter:
        eqn = defs.get(var)
        if eqn is None or eqn.primitive.name not in ("add", "sub", "convert_element_type"):
            return False
        dynamic = [v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)]
        if len(dynamic) != 1:  # (c - i is affine too: the backward walks its stacks down)
            return False
        var = dynamic[0]
    return True


def test_the_loops_read_their_stacks_at_indices_affine_in_the_counter():
    """What makes XLA copy a row of a host stack instead of running a kernel that reads host memory (module
    docstring, "Fetches"; checked on the compiled program by tests/test_frozen_weights_gpu.py): both loops of the
    streamed scan take no scanned inputs (no index array), and every dynamic slice in their bodies is indexed by
    the loop's carried counter plus or minus constants, never clamped."""
    x, lora, frozen, table = _inputs(10)
    loss = _streamed_loss(offloaded_scan, HostRows(_on_host(frozen)))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=1))(x, lora, table).jaxpr
    scans = [eqn for eqn in jaxpr_eqns(jaxpr) if eqn.primitive.name == "scan"]
    assert len(scans) == 2  # the forward loop, the backward loop
    for eqn in scans:
        consts, carry, xs = (len(list(part)) for part in eqn.params["ft_in"].unpack())  # JAX 0.11's scan params
        assert xs == 0 and len(eqn.invars) == consts + carry and eqn.params["length"] == L - 1
        body = eqn.params["jaxpr"].jaxpr
        counter = body.invars[consts + carry - 1]  # the counter is the carry's last leaf
        defs = {v: e for e in body.eqns for v in e.outvars}
        slices = list(_slice_indices(body))
        # non-vacuous: the loop reads rows of a stack in host memory
        assert any(getattr(stack.aval, "memory_space", None) == jax.memory.Space.Host for stack, _ in slices)
        for stack, indices in slices:
            for index in indices:
                assert isinstance(index, jax.extend.core.Literal) or _affine_in_counter(index, counter, defs), \
                    (stack, defs.get(index))
        assert not any(e.primitive.name in ("min", "max", "clamp") for e in body.eqns)


def _slice_indices(body):
    """(sliced operand, its index operands) of every dynamic slice in a loop body: direct ones, and the calls of
    `jax.lax.dynamic_index_in_dim` (a jit whose own body normalises a negative index, then slices)."""
    for eqn in body.eqns:
        if eqn.primitive.name == "dynamic_slice":
            yield eqn.invars[0], eqn.invars[1:]
        elif eqn.primitive.name == "jit" and any(e.primitive.name == "dynamic_slice"
                                                 for e in eqn.params["jaxpr"].jaxpr.eqns):
            yield eqn.invars[0], [v for v in eqn.invars[1:] if v.aval.shape == ()]
