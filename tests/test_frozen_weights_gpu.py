"""`frozen_weights: host` on a GPU: the packed weights are host arguments of the compiled step (not device memory),
each loop body fetches one packed row per layer from host memory under the layer's matmuls, as a copy (not a
kernel reading host memory), and the step's loss and
LoRA gradients equal those over the weights on the device. A 4-layer model of 1024 width, fp32, 1 x 1024 tokens,
remat offload+attn (the policy that keeps residuals over streamed weights: `jaxft.memory.scan_offload._Residuals`). On
the CPU these checks cannot be made: its memory analysis counts host arguments as arguments, and JAX lowers no
placement there (tests/test_frozen_weights_host.py checks the gradients on the CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxft.config import ModelConfig
from jaxft.memory.execution import ExecutionConfig
from jaxft.lora import LoraConfig, apply_lora
from jaxft.models.build import init_model
from jaxft.memory.scan_offload import is_slot
from jaxft.memory.streamed import pack
from jaxft.train.step import loss_and_grad_sums, split_model, stack_micro_batches
from gpu_helpers import NO_AUTOTUNE
from lora_helpers import perturb_lora_b

from hlo_text import gemms_under_fetches, host_slice_counts  # plain text parsing: no plugin set-up

pytestmark = pytest.mark.gpu

CFG = ModelConfig(model_type="llama", vocab_size=2048, hidden_size=1024, intermediate_size=4096, num_layers=4,
                  num_heads=16, num_kv_heads=4, head_dim=64)
T = 1024


def _setup():
    model = apply_lora(init_model(CFG, dtype=jnp.float32, seed=0), LoraConfig(r=8, alpha=16), seed=1)
    perturb_lora_b(model)
    graphdef, lora, frozen = split_model(model)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CFG.vocab_size, (1, T + 1)).astype(np.int32)
    batch = stack_micro_batches(dict(input_ids=ids[:, :-1], targets=ids[:, 1:], loss_mask=np.ones((1, T), np.float32),
                                     segment_ids=np.ones((1, T), np.int32),
                                     positions=np.arange(T, dtype=np.int32)[None]), 1)
    return graphdef, lora, frozen, jax.device_put(batch)


def _compiled(graphdef, lora, frozen, batch, weights: str):
    ex = ExecutionConfig(attention_implementation="reference", remat="offload+attn", layer_loop="scan",
                         frozen_weights=weights)
    step = jax.jit(lambda lo, fz, b: loss_and_grad_sums(graphdef, lo, fz, b, None, ex)[:2])
    # XLA's own GEMM emitters (NO_AUTOTUNE, not FAST_COMPILE): with cuBLAS for every GEMM the matmuls sit in called
    # computations (command buffers) that `gemms_under_fetches` does not see into (compiled for an H200 on a CPU:
    # 0 GEMMs under both fetches with cuBLAS, 9 and 19 with the default emitters, experiments/deviceless/).
    return step.lower(lora, frozen, batch).compile(compiler_options={**NO_AUTOTUNE, **ex.program_options})


def test_streamed_weights_are_host_arguments_fetched_under_compute_with_equal_gradients():
    graphdef, lora, frozen, batch = _setup()
    device = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    streamed = pack(frozen, host)
    rows = {v.key: v.rows for v in jax.tree.leaves(streamed, is_leaf=is_slot) if is_slot(v)}
    packed_bytes = sum(r.size * r.dtype.itemsize for r in rows.values())
    assert packed_bytes > 0 and all(r.sharding.memory_kind == "pinned_host" for r in rows.values())

    on_device = _compiled(graphdef, lora, frozen, batch, "device")
    on_host = _compiled(graphdef, lora, streamed, batch, "host")
    dev_mem, host_mem = on_device.memory_analysis(), on_host.memory_analysis()
    # The packed weights left the device arguments (less the small rows that stay: norms, LoRA scales/ranks).
    assert dev_mem.argument_size_in_bytes - host_mem.argument_size_in_bytes >= 0.95 * packed_bytes
    assert host_mem.host_argument_size_in_bytes >= packed_bytes
    # Each layer's row is fetched under compute: the forward's and the backward's fetch in their loop bodies.
    text = on_host.as_text()
    fetches = gemms_under_fetches(text)
    assert len(fetches) >= 2 and sum(1 for n in fetches if n > 0) >= 2, fetches
    # ... as copies: every slice of a host buffer is a memcpy but the first layer's row, read before the forward loop
    # (one per packed buffer); a kernel would read host memory over PCIe on the matmuls' SMs (offload_scan, "Fetches")
    copies, kernels = host_slice_counts(text)
    assert copies >= 2 and kernels <= len(rows), (copies, kernels)

    want_loss, want_grads = on_device(lora, frozen, batch)
    got_loss, got_grads = on_host(lora, streamed, batch)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-4 * float(np.max(np.abs(w))) + 1e-8)
