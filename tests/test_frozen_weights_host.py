"""`frozen_weights: host` (ExecutionConfig): the layer stacks' frozen weights in pinned host memory, each layer's rows
streamed to the device one layer ahead through `jaxft.offload_scan` (forward and backward). On the CPU the copies
are identities, so the gradients must equal those of the same remat policy over weights on the device: a Llama
(one group), Gemma 2 (a periodic scan: blocks of rows per iteration) and a mixed dense/sparse Qwen3-MoE stack whose
expert stacks stay on the device; jaxft-train's path places them and trains to the same losses; settings it does
not run under get one line naming the key. Where the copies run on the GPU (one layer ahead, under compute) is
compiled for an H200 in scripts/deviceless/stream_schedule.py; the CUDA-lowered placements are
tests/test_offload_scan.py's."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jaxft.execution import ExecutionConfig, ExecutionConfigError
from jaxft.models.stack import streamed_weight
from jaxft.offload_scan import in_host_memory
from test_remat import assert_grads_match, grads, lora_split
from test_remat_nested import GEMMA4, LLAMA5, MOE


def on_host(frozen: nnx.State) -> nnx.State:
    """`frozen` with the entries `frozen_weights: host` streams in pinned host memory (as `Run.frozen_shardings`)."""
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    return nnx.from_flat_state([(p, v.replace(jax.device_put(v.get_value(), host)) if streamed_weight(p, v) else v)
                                for p, v in nnx.to_flat_state(frozen)])


@pytest.mark.parametrize("remat", ["full", "offload"])
@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen3_moe"])
def test_streamed_weights_give_the_gradients_of_weights_on_the_device(name, remat):
    cfg = {"llama": LLAMA5, "gemma2": GEMMA4, "qwen3_moe": MOE}[name]
    graphdef, lora, frozen = lora_split(cfg)
    streamed = on_host(frozen)
    flat = nnx.to_flat_state(streamed)
    assert sum(in_host_memory(v.get_value()) for _, v in flat) > 0
    # embeddings, head, final norm and the expert stacks stay on the device
    assert all(not in_host_memory(v.get_value()) for p, v in flat if p[0] not in ("layers", "dense_layers",
                                                                                   "moe_layers"))
    if name == "qwen3_moe":
        experts = [v for p, v in flat if not streamed_weight(p, v) and p[0] in ("layers", "moe_layers")]
        assert experts and not any(in_host_memory(v.get_value()) for v in experts)
    want = grads(cfg, (graphdef, lora, frozen), remat, "scan")
    got = grads(cfg, (graphdef, lora, streamed), remat, "scan", frozen_weights="host")
    assert_grads_match(*got, *want)


def test_streamed_weights_outside_the_streaming_policies_are_refused_in_the_step():
    """The step itself refuses a host-memory stack it cannot stream (a policy that keeps residuals), as the config
    check does for jaxft-train's keys."""
    graphdef, lora, frozen = lora_split(LLAMA5)
    with pytest.raises(ValueError, match="stream through the layer scan under remat full or offload"):
        grads(LLAMA5, (graphdef, lora, on_host(frozen)), "offload+attn", "scan")


@pytest.mark.parametrize("settings, needle", [
    (dict(remat="none"), "'host' runs under remat full or offload (got 'none')"),
    (dict(remat="offload+attn"), "(got 'offload+attn')"),
    (dict(remat="auto"), "(got 'auto')"),
    (dict(remat="full", layer_loop="unroll"), "set layer_loop: scan (or auto)"),
    (dict(remat="offload", remat_block=2), "remat_block (nested blocks) do not combine yet"),
    (dict(remat="full", frozen_weights="cpu"), "value 'cpu' is not one of 'device', 'host'"),
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


def test_a_run_with_weights_in_host_memory_trains_as_on_the_device(tmp_path):
    """jaxft-train's path (jaxft.train.train) on a tiny 3-layer Llama: the same logged losses with the weights on
    the device and in pinned host memory, under remat offload."""
    from test_train_fixtures import tiny_run_losses

    want = tiny_run_losses(tmp_path, "device", remat="offload")
    got = tiny_run_losses(tmp_path, "host", remat="offload", frozen_weights="host")
    assert len(got) == len(want) == 3
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_the_run_places_the_layer_weights_in_host_memory(tmp_path):
    """`Run.frozen_shardings`: the stacks' entries in pinned host memory, the rest on the device; the step compiled
    with those shardings runs; `Run.model()` (generation) gets the weights on the device."""
    from jaxft.lora import LoraConfig
    from jaxft.run import Run
    from test_run import _batches
    from test_train_fixtures import make_tiny_model

    model = make_tiny_model(tmp_path / "m", hidden=32, layers=2)
    run = Run(model, LoraConfig(r=4, alpha=8), dtype="float32",
              execution=ExecutionConfig(attention_implementation="reference", remat="full",
                                        frozen_weights="host")).load()
    flat = nnx.to_flat_state(run.frozen)
    kinds = {p: v.get_value().sharding.memory_kind for p, v in flat}
    assert {kinds[p] for p, v in flat if streamed_weight(p, v)} == {"pinned_host"}
    assert kinds[("embed", "embedding")] == "device" and kinds[("lm_head", "kernel")] == "device"
    assert np.isfinite(float(run.step(_batches(1)[0], 0)["loss"]))
    _, state = nnx.split(run.model())
    assert all(not in_host_memory(leaf) for leaf in jax.tree.leaves(state))
