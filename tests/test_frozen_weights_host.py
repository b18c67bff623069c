"""`frozen_weights: host` (ExecutionConfig): the layer stacks' frozen weights in pinned host memory, each layer's rows
streamed to the device one layer ahead through `jaxft.memory.scan_offload` (forward and backward). On the CPU the copies
are identities, so the gradients must equal those of the same remat policy over weights on the device: a Llama
(one group) and Gemma 2 (a periodic scan: blocks of rows per iteration); GPT-OSS's expert stacks stream too and
train their adapters (a 4-bit base's codes: test_mixed_4bit); `Run` packs them and trains to the same losses;
settings it does not run under get one line naming the key. Where the copies run on the GPU (one layer ahead, under
compute) is compiled for an H200 in experiments/deviceless/stream_schedule.py; the CUDA-lowered
placements are tests/test_offload_scan.py's."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from flax import nnx

from jaxft.memory.execution import ExecutionConfig, ExecutionConfigError
from jaxft.models.stack import streamed_weight
from jaxft.memory.scan_offload import in_host_memory
from jaxft.memory.policy import parse
from jaxft.memory.streamed import is_packed as streamed_is_packed
from jaxft.memory.streamed import pack
from test_remat import assert_grads_match, grads, lora_split
from test_remat_nested import GEMMA4, LLAMA5


HOST = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")


def on_host(frozen: nnx.State) -> nnx.State:
    """`frozen` with the entries `frozen_weights: host` streams in pinned host memory, one array each (the packed
    form is `jaxft.memory.streamed.pack`'s, what `Run` places)."""
    return nnx.from_flat_state([(p, v.replace(jax.device_put(v.get_value(), HOST)) if streamed_weight(p, v) else v)
                                for p, v in nnx.to_flat_state(frozen)])


ATTN_ON_HOST = "offload=layer_input,attn_out,attn_lse"  # offload+attn with the attention's residuals on the host
# Each structure (one group, a periodic scan), both forms (packed buffers as `Run` places them, one host array per
# leaf) and each way a policy meets the streamed scan at least once: the scan's fetches do not depend on the policy,
# and the policies' own gradients are tests/test_remat.py's. Here: residuals moved to the host (Llama, per leaf),
# residuals kept on the device (Gemma 2 takes offload+attn: its periodic scan rounds furthest apart). Nothing kept
# (remat full) over packed Llama weights: test_the_run_packs_the_layer_weights_into_one_host_buffer; the layer input
# alone to the host (offload): test_mixed_4bit::test_frozen_weights_on_the_host_and_unrolled_layers_give_the_
# gradients_of_weights_on_the_device (a 4-bit base's codes and scales packed and streamed, a mixed layout's own rows);
# expert stacks streamed as packed rows, their adapters trained:
# test_gpt_oss_with_expert_adapters_trains_over_streamed_experts.
CASES = [("per_leaf", "llama", ATTN_ON_HOST), ("packed", "gemma2", "offload+attn")]


@pytest.mark.parametrize("form, name, remat", CASES)
def test_streamed_weights_give_the_gradients_of_weights_on_the_device(name, remat, form):
    """Llama: one group of 5 layers; Gemma 2: a periodic scan, each iteration a block of two rows. A policy that
    keeps residuals (offload+attn: attention output and statistics) keeps them over streamed weights too, and a
    policy that offloads them (the attention's residuals) moves them through the scan to the host and back."""
    cfg = {"llama": LLAMA5, "gemma2": GEMMA4}[name]
    graphdef, lora, frozen = lora_split(cfg)
    streamed = pack(frozen, HOST) if form == "packed" else on_host(frozen)
    flat = nnx.to_flat_state(streamed)
    assert sum(in_host_memory(leaf) for leaf in jax.tree.leaves(streamed)) > 0
    # embeddings, head and final norm stay on the device
    assert all(not in_host_memory(leaf) for p, v in flat if p[0] not in ("layers", "dense_layers", "moe_layers")
               for leaf in jax.tree.leaves(v.get_value()))
    want = grads(cfg, (graphdef, lora, frozen), remat, "scan")
    got = grads(cfg, (graphdef, lora, streamed), remat, "scan", frozen_weights="host")
    # 5e-6 of each leaf's largest entry: the streamed scan runs one iteration in each direction outside its loops
    # (`jaxft.memory.scan_offload`, "Fetches"), so those layers fuse on their own and round apart (Gemma 2's periodic
    # scan: 4.1e-6 at most)
    assert_grads_match(*got, *want, scale_tol=5e-6)


def test_streamed_weights_outside_the_streaming_policies_are_refused_in_the_step():
    """The step itself refuses a host-memory stack under a policy that keeps some residuals on the device and
    offloads others (jax.checkpoint's host copies would be stacked by the scan), as the config check does for
    jaxft-train's keys."""
    graphdef, lora, frozen = lora_split(LLAMA5)
    with pytest.raises(ValueError, match="offloads at most the layer input"):
        grads(LLAMA5, (graphdef, lora, on_host(frozen)), "save=attn_out;offload=layer_input,mlp_input", "scan")


@pytest.mark.parametrize("settings, needle", [
    (dict(remat="save=attn_out;offload=layer_input,mlp_input"), "'host' runs under a remat policy that offloads at "
     "most the layer input or keeps nothing on the device (got 'save=attn_out;offload=layer_input,mlp_input')"),
    (dict(remat="full", layer_loop="unroll"), "set layer_loop: scan (or auto)"),
    (dict(remat="offload", remat_block=2), "remat_block (nested blocks) do not combine yet"),
    (dict(remat="full", frozen_weights="cpu"), "value 'cpu' is not one of 'auto', 'device', 'host'"),
])
def test_settings_it_does_not_run_under_get_one_line(settings, needle):
    with pytest.raises(ExecutionConfigError) as info:
        ExecutionConfig(**{"frozen_weights": "host", **settings})
    assert info.value.field == "frozen_weights" and needle in str(info.value)
    assert "\n" not in str(info.value)


def test_the_scan_is_chosen_and_the_fetches_may_overlap():
    ex = ExecutionConfig(remat="full", frozen_weights="host")
    assert ex.resolved_layer_loop == "scan"
    assert ex.program_options["xla_gpu_experimental_parallel_async_compute_limit"] == 8
    assert "xla_gpu_experimental_parallel_async_compute_limit" not in ExecutionConfig(remat="full").program_options
    assert ExecutionConfig(remat="full", frozen_weights="host", compiler_options={
        "xla_gpu_experimental_parallel_async_compute_limit": 2}).program_options[
        "xla_gpu_experimental_parallel_async_compute_limit"] == 2


def test_the_run_packs_the_layer_weights_into_one_host_buffer(tmp_path):
    """`Run` with frozen_weights host: every streamed entry (the stacked matrices) is a `PackedSlot` into ONE
    pinned-host buffer per stack and dtype ([L, total], so each layer's weights reach the device in one copy), the rest stays on the device;
    unpacked, the weights are the loaded ones. A step compiled from shapes before loading serves the loaded run; its
    losses and eval loss equal the device run's, and a variant over the same weights back on the device agrees. `Run.model()`
    gives host arrays (exports), `on_device=True` a device copy (generation)."""
    from jaxft.lora import LoraConfig
    from jaxft.memory.scan_offload import PackedSlot
    from jaxft.run import Run
    from jaxft.memory.streamed import unpack
    from test_run import _batches
    from test_train_fixtures import make_tiny_model

    model = make_tiny_model(tmp_path / "m", hidden=32, layers=2)

    def run_of(weights):
        return Run(model, LoraConfig(r=4, alpha=8), dtype="float32", total_steps=3,
                   execution=ExecutionConfig(attention_implementation="reference", remat="full",
                                             frozen_weights=weights))

    batches = _batches(3, vocab=64)
    host = run_of("host")
    host.compile(batches[0])  # from shapes: the abstract state is packed as the loaded one will be
    host.load()
    device = run_of("device").load()
    flat = nnx.to_flat_state(host.frozen)
    slots = {p: v.get_value() for p, v in flat if isinstance(v.get_value(), PackedSlot)}
    assert slots and set(slots) == {p for p, v in nnx.to_flat_state(device.frozen) if streamed_weight(p, v)}
    assert all(len(v.shape) == 2 for v in slots.values())  # the stacked matrices
    buffers = {id(v.rows): v.rows for v in slots.values()}
    assert len(buffers) == 1
    (rows,) = buffers.values()
    assert rows.sharding.memory_kind == "pinned_host"
    assert rows.shape == (2, sum(v.size for v in slots.values()))
    assert {p: v.get_value().sharding.memory_kind for p, v in flat if p not in slots} == \
        {p: "device" for p, v in flat if p not in slots}
    want = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(device.frozen)}
    got = {p: v.get_value() for p, v in nnx.to_flat_state(unpack(host.frozen))}
    assert got.keys() == want.keys()
    for p in want:
        np.testing.assert_array_equal(np.asarray(got[p]), want[p])
    losses = [float(host.step(b, i)["loss"]) for i, b in enumerate(batches)]
    np.testing.assert_allclose(losses, [float(device.step(b, i)["loss"]) for i, b in enumerate(batches)], rtol=1e-6)
    np.testing.assert_allclose(host.evaluate(batches[:1]), device.evaluate(batches[:1]), rtol=1e-6)  # the eval step
    there = device.variant(device.execution.replace(frozen_weights="host"))  # packs a copy: device keeps its own
    assert streamed_is_packed(there.frozen) and not streamed_is_packed(device.frozen)
    assert all(not v.get_value().is_deleted() for _, v in nnx.to_flat_state(device.frozen))
    back = host.variant(host.execution.replace(frozen_weights="device"))
    assert not any(isinstance(v.get_value(), PackedSlot) for _, v in nnx.to_flat_state(back.frozen))
    for p, v in nnx.to_flat_state(back.frozen):
        np.testing.assert_array_equal(np.asarray(v.get_value()), want[p])
    _, exported = nnx.split(host.model())
    _, generating = nnx.split(host.model(on_device=True))
    kernel = ("layers", "attn", "q_proj", "kernel")
    assert isinstance(dict(nnx.to_flat_state(exported))[kernel].get_value(), np.ndarray)
    assert dict(nnx.to_flat_state(generating))[kernel].get_value().sharding.memory_kind == "device"


def test_a_run_over_several_devices_is_refused_in_one_line():
    from jaxft.lora import LoraConfig
    from jaxft.run import Run

    two = [jax.devices()[0]] * 2  # refused before any mesh is made of them
    with pytest.raises(ExecutionConfigError, match="streams one device's weights; this run has 2 devices"):
        Run("examples/tiny-llama", LoraConfig(r=4), execution=ExecutionConfig(remat="full", frozen_weights="host"),
            devices=two)


def test_gpt_oss_with_expert_adapters_trains_over_streamed_experts(tmp_path):
    """GPT-OSS (sinks, alternating windows, expert biases, interleaved gate/up) with LoRA on attention and on the
    experts (PEFT target_parameters): its expert stacks stream with the rest; three steps give the device run's
    losses. Two layers, one period of its windows (the streamed scan's loop over several iterations: the Gemma 2
    case above)."""
    from jaxft.lora import LoraConfig
    from jaxft.models.layers import ExpertParam
    from jaxft.memory.scan_offload import PackedSlot
    from jaxft.run import Run
    from test_moe_gmm_choice import _saved
    from test_remat_auto import _batch

    model = _saved("gpt_oss", tmp_path / "m", 2)
    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])

    def losses(weights):
        run = Run(model, lora_config=lora, dtype="float32", total_steps=10,
                  execution=ExecutionConfig(attention_implementation="reference", remat="offload+attn",
                                            frozen_weights=weights)).load()
        return run, [float(run.step(_batch(), i)["loss"]) for i in range(3)]

    host, got = losses("host")
    _, want = losses("device")
    experts = [v.get_value() for _, v in nnx.to_flat_state(host.frozen) if isinstance(v, ExpertParam)]
    assert experts and all(isinstance(e, PackedSlot) for e in experts)
    assert len(set(want)) == 3
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_sample_generation_with_streamed_weights_is_warned_about(tmp_path):
    """Generation does not stream: with eval_generate_prompts the plan the loop prints (`Run.describe`) warns that
    each sample generation copies the streamed weights to the device; without sample prompts it does not."""
    from jaxft.run import Run
    from jaxft.train import TrainConfig
    from test_train_fixtures import make_jsonl, make_tiny_model

    model = make_tiny_model(tmp_path / "m", layers=2)
    make_jsonl(tmp_path / "d.jsonl", 4)
    config = TrainConfig(model_name_or_path=str(model), dataset=str(tmp_path / "d.jsonl"),
                         output_dir=str(tmp_path / "o"), remat="offload", frozen_weights="host",
                         eval_generate_prompts=["reverse: cat dog\n"])
    run = Run.from_config(config, total_steps=1)
    warnings = [line for level, line in run.describe(1, 64, samples=True) if level == logging.WARNING]
    assert any("each sample generation copies the 0.04 MiB of streamed weights to the device" in line
               for line in warnings), warnings  # bf16
    assert not any("sample generation" in line for _, line in run.describe(1, 64, samples=False))


def test_what_each_policy_keeps_where_over_streamed_weights():
    """`RematPolicy.streaming`: (the layer's checkpoint policy, layer input on the host, kept residuals on the
    host). A policy that keeps nothing on the device streams with what it keeps moved by the scan; one that keeps
    names on the device and offloads others does not stream, in one line."""
    assert parse("full").streaming() == (None, False, False)
    assert parse("offload").streaming() == (None, True, False)
    assert parse("offload+attn").streaming()[1:] == (True, False)
    assert parse("none").streaming()[1:] == (False, False)
    assert parse("offload=layer_input,attn_out,attn_lse").streaming()[1:] == (True, True)
    assert parse("offload=attn_out,attn_lse").streaming()[1:] == (False, True)
    assert not parse("save=attn_out;offload=layer_input,mlp_input").streams
    with pytest.raises(ValueError, match="keeps .* on the device and offloads .*: over streamed weights"):
        parse("save=attn_out;offload=layer_input,mlp_input").streaming()
