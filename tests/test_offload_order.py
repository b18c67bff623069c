"""The order the explicit host offload (jaxft.memory.offload) imposes on an unrolled layer loop, read from the step's
jaxpr: what keeps its device temp at or below full remat's on the GPU (the CPU lowers no placement and its scheduler
shows neither effect, so its compiled memory cannot; tests/test_remat_gpu.py measures the GPU program).

Measured on a compile for the H200 (4 layers of Llama-3.2-1B widths, 1 x 2048, Pallas attention, temp of the
compiled step): no remat 615 MiB, full 322 MiB, explicit offload 562 MiB before, 275 MiB after. The two causes:
- each layer's LoRA weight-gradient matmuls were scheduled at the end of the program, next to the stacked gradient
  they feed, so every layer's recomputed activations (their operands) stayed live through the backward of all the
  layers below: now a barrier holds the layer's weight cotangents with its input cotangent;
- the copy of each layer input to the host completed next to its only use, in the backward, so the device copy
  lived through the forward: now a barrier holds the host copy with the layer's output."""

from __future__ import annotations

import collections

import jax
import pytest

from jaxft.memory.execution import ExecutionConfig
from jaxft.train.step import loss_and_grad_sums, stack_micro_batches, unstack_layers
from test_remat import llama, lora_split, packed_batch

LAYERS = 3


def _jaxprs(jaxpr):
    """`jaxpr` and every jaxpr in its equations' parameters (scan bodies, jit calls), recursively."""
    yield jaxpr
    for eqn in jaxpr.eqns:
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from _jaxprs(inner)


def _eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs in its equations' parameters."""
    for inner in _jaxprs(jaxpr):
        yield from inner.eqns


def _unrolled_step(transfer: str, remat: str):
    """(jaxpr of the unrolled step's gradient under `remat` / `offload_transfer`, the LoRA tree, the batch, cfg)."""
    cfg = llama(LAYERS)
    graphdef, lora, frozen = lora_split(cfg)
    batch = stack_micro_batches(packed_batch(cfg.vocab_size), 1)
    ex = ExecutionConfig(attention_implementation="reference", remat=remat, layer_loop="unroll",
                         offload_transfer=transfer)
    closed = jax.make_jaxpr(lambda lo, fz, b: loss_and_grad_sums(graphdef, lo, fz, b, None, ex)[1])(
        lora, unstack_layers(frozen), batch)
    return closed.jaxpr, lora, batch, cfg


def _barriers(transfer: str, remat: str = "offload"):
    """[(output shapes, whether one output is in host memory)] of the optimization barriers of an unrolled step
    under `remat`, plus the per-layer LoRA leaf shapes and the layer input's shape."""
    jaxpr, lora, batch, cfg = _unrolled_step(transfer, remat)
    found = [([tuple(v.aval.shape) for v in eqn.outvars], any("<host>" in str(v.aval) for v in eqn.outvars))
             for eqn in _eqns(jaxpr) if eqn.primitive.name == "optimization_barrier"]
    per_layer = sorted(tuple(leaf.shape[1:]) for leaf in jax.tree.leaves(lora))
    b, t = batch["input_ids"].shape[1:]
    return found, per_layer, (b, t, cfg.hidden_size)


def _weight_gradient_barriers(found, per_layer, stream):
    """The barriers whose results are exactly one layer's LoRA cotangents, with or without the layer input's."""
    want = collections.Counter(per_layer)
    return [shapes for shapes, host in found if not host
            and collections.Counter(s for s in shapes if s != stream) == want]


def test_each_layer_finishes_its_weight_gradients_before_its_input_cotangent_leaves():
    found, per_layer, stream = _barriers("explicit")
    held = _weight_gradient_barriers(found, per_layer, stream)
    assert len(held) == LAYERS, (len(held), per_layer)
    # The input cotangent rides along except for layer 0, whose input (the frozen embedding's output) is not
    # differentiated; no frozen weight's cotangent is in any of them (a barrier would force computing it).
    assert sorted(shapes.count(stream) for shapes in held) == [0] + [1] * (LAYERS - 1)


def test_the_host_copy_of_a_layer_input_completes_before_the_layer_output_is_used():
    found, _, stream = _barriers("explicit")
    host = [shapes for shapes, on_host in found if on_host]
    # Per layer: (host copy, layer output) in the forward and (host copy, prefetch signal) in the backward.
    assert sorted(host) == [[stream, ()]] * LAYERS + [[stream, stream]] * LAYERS


def _signal_sources(remat: str = "offload"):
    """For each backward barrier that holds a host copy with a scalar (the copy back's gate): what made the
    scalar - "signal" (a barrier of a layer's output cotangent with a scalar: the start of that layer's
    backward) or "constant"."""
    sources = []
    for jaxpr in _jaxprs(_unrolled_step("explicit", remat)[0]):
        made = {}  # variable -> the equation that made it, within this jaxpr
        for eqn in jaxpr.eqns:
            made.update({v: eqn for v in eqn.outvars})
            shapes = [tuple(v.aval.shape) for v in eqn.outvars]
            if (eqn.primitive.name == "optimization_barrier" and shapes[-1] == ()
                    and any("<host>" in str(v.aval) for v in eqn.outvars)):
                maker = made.get(eqn.invars[-1]) if not isinstance(eqn.invars[-1], jax.extend.core.Literal) else None
                signal = (maker is not None and maker.primitive.name == "optimization_barrier"
                          and [tuple(v.aval.shape) for v in maker.outvars][-1] == ()
                          and not any("<host>" in str(v.aval) for v in maker.outvars))
                sources.append("signal" if signal else "constant")
    return sources


@pytest.mark.parametrize("remat", ["offload", "offload+attn", "offload=layer_input,attn_out,attn_lse"])
def test_each_copy_back_starts_when_the_layer_above_starts_its_backward(remat):
    """Unrolled: layer i's copy back is gated by the scalar layer i+1 makes from its output cotangent (the
    start of its backward, `jaxft.memory.offload.PrefetchChain`), so the copy runs under layer i+1's recompute and
    backward instead of after it (measured on the H200 before: 1.2 ms of idle compute per layer, 8B width at
    1 x 8192). The top layer has no layer above (a constant). The same for the
    policies that keep more (their vjp inside the custom VJP): their offloaded residuals are copied back early,
    what they keep on the device is read in place."""
    assert sorted(_signal_sources(remat)) == ["constant"] + ["signal"] * (LAYERS - 1)


def test_the_policy_transfer_has_neither_barrier():
    """The policy's offload (jax.checkpoint) is untouched: its barriers hold the checkpoint's inputs, no host copy
    and no set of weight cotangents (so the two tests above see the explicit transfer's own barriers)."""
    found, per_layer, stream = _barriers("policy")
    assert not _weight_gradient_barriers(found, per_layer, stream)
    assert not any(host for _, host in found)


def test_a_policy_that_keeps_residuals_offloads_through_the_same_barriers_when_unrolled():
    """A policy keeping most residuals on the device and moving the [B,T,H] ones to the host; unrolled, its copies
    go through the explicit transfer too (the jax.checkpoint offload there kept more device memory than no remat:
    compiled for an H200, 4 Gemma-2-9B layers at 1 x 4096, temp 4.44 GiB vs 4.10 without remat; 3.30 this way).
    Per layer: one barrier holding the host copies with the layer output, one holding them with the prefetch
    signal (so the copies back wait for it), and the weight-gradient barrier."""
    found, per_layer, stream = _barriers("auto", "save=attn_out,attn_lse,attn_qkv,mlp_gate_up;"
                                                 "offload=layer_input,mlp_input")
    host = [shapes for shapes, on_host in found if on_host]
    assert len(host) == 2 * LAYERS, host
    # Llama has no output norms: the layer input and the MLP input go to the host, both [B,T,H].
    gates = [shapes for shapes in host if shapes == [stream, stream, ()]]
    forward = [shapes for shapes in host if shapes != [stream, stream, ()]]
    assert len(gates) == len(forward) == LAYERS and all(shapes.count(stream) >= 3 for shapes in forward), host
    assert len(_weight_gradient_barriers(found, per_layer, stream)) == LAYERS
