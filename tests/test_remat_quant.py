"""Remat policies on a 4-bit base (QLoRA): the layers' NF4 matmuls are custom VJPs whose code table is a constant
of the layer, which the explicit host offload (`jaxft.memory.offload`) hoists into arguments; training through it gives
the steps of no remat (it raised JAX's "differentiation of a custom_vjp with respect to a closed-over value")."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxft.memory.execution import ExecutionConfig
from jaxft.lora import LoraConfig
from jaxft.quant import QuantConfig
from jaxft.run import Run
from test_remat_auto import _batch
from test_train_fixtures import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("quant_remat") / "model", hidden=64, layers=3)


def _train(model_dir, **execution):
    run = Run(model_dir, lora_config=LoraConfig(r=4, alpha=8), dtype="float32", quant_config=QuantConfig(), total_steps=10,
              execution=ExecutionConfig(attention_implementation="reference", layer_loop="unroll", **execution))
    run.load()
    losses = [float(run.step(_batch(), i)["loss"]) for i in range(3)]
    return losses, jax.tree.leaves(run.lora)


def test_4bit_base_trains_alike_under_remat_in_the_unrolled_loop(model_dir):
    """remat offload in the unrolled loop takes the explicit transfer (the custom VJP that hoisted the code table);
    full remat over a 4-bit base: test_mixed_4bit::test_qlora_trains_on_the_mixed_checkpoint_and_resumes."""
    want_losses, want_lora = _train(model_dir, remat="none")
    losses, lora = _train(model_dir, remat="offload")
    assert len(set(want_losses)) == 3  # the steps move the adapters
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert len(lora) == len(want_lora) > 0
    for got, want in zip(lora, want_lora):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-5)
