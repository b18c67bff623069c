"""The training step's math: exact gradient accumulation, packing invariance, LoRA-only updates, schedules."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxft.config import ModelConfig
from jaxft.data.formatting import Document
from jaxft.data.packing import PackedDataset
from jaxft.lora import LoraConfig, apply_lora
from jaxft.models import init_model
from jaxft.train import (make_optimizer, make_schedule, make_train_step, split_model,
                         stack_micro_batches, token_loss_sum, warmup_steps_for)

CFG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=1024)


def _lora_model(seed=0):
    """fp32 tiny Llama with LoRA r=4 on every linear, B randomised so that every LoRA matrix gets a gradient."""
    model = init_model(CFG, dtype=jnp.float32, seed=seed)
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"), seed=seed)
    graphdef, lora, frozen = split_model(model)
    keys = iter(jax.random.split(jax.random.key(seed + 1), len(jax.tree.leaves(lora))))
    lora = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), lora)
    return graphdef, lora, frozen


def _random_batch(rows, t, seed):
    """Packed rows of 1-3 documents with ragged padding and a random loss mask (so micro-batches differ in
    target counts and a mean of per-micro-batch means would NOT equal the global mean)."""
    rs = np.random.RandomState(seed)
    docs = []
    for _ in range(rows * 4):  # more tokens than `rows` rows hold: the first `rows` packed rows are all used
        n = int(rs.randint(3, t // 2))
        docs.append(Document(rs.randint(4, CFG.vocab_size, n), rs.rand(n) < rs.uniform(0.2, 0.9), "rand"))
    return PackedDataset(docs, max_seq_length=t, batch_size=rows, shuffle=False).batch(0)


def _first_moments(opt_state) -> list:
    """Adam's first moments (mu) in an optimizer state: after one update, (1 - b1) x the (clipped) gradient."""
    return [x for path, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]
            if any(getattr(k, "name", None) == "mu" for k in path)]


def test_grad_accumulation_is_exact_and_only_lora_buffers_are_trained_and_donated():
    """One step over 8 rows == 4 accumulated micro-batches of 2 rows: the target count, the loss, the gradient
    norm, the gradients themselves (Adam's first moments after the update: (1 - b1) x the gradient of the mean loss,
    clipped by the norm's factor, equal above), and the whole update (clipping + AdamW). The accumulating step
    donates its LoRA and optimizer buffers (the base weights only read, unchanged), and the optimizer state holds
    the LoRA matrices' moments only."""
    graphdef, lora, frozen = _lora_model()
    frozen_before = jax.tree.map(np.array, frozen)
    host = _random_batch(8, 48, seed=3)
    schedule = make_schedule("constant", 1e-2, 10, 0)
    opt = make_optimizer(schedule, weight_decay=0.1, max_grad_norm=0.5)
    step = make_train_step(graphdef, opt, schedule, donate=False)
    out_full = step(lora, opt.init(lora), frozen, stack_micro_batches(host, 1), jax.random.key(0))
    donated_lora, donated_state = jax.tree.map(jnp.copy, lora), opt.init(lora)
    state_arrays = [x for x in jax.tree.leaves(donated_state) if x.ndim > 0]
    assert len(state_arrays) == 2 * len(jax.tree.leaves(lora))  # mu and nu of each LoRA matrix, nothing else
    assert sum(x.size for x in state_arrays) == 2 * sum(x.size for x in jax.tree.leaves(lora))
    donating = make_train_step(graphdef, opt, schedule)  # donates lora and opt_state
    out_micro = donating(donated_lora, donated_state, frozen, stack_micro_batches(host, 4), jax.random.key(0))
    jax.block_until_ready(out_micro)
    assert all(x.is_deleted() for x in jax.tree.leaves(donated_lora)) and all(x.is_deleted() for x in state_arrays)
    assert not any(x.is_deleted() for x in jax.tree.leaves(frozen))
    for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(frozen)):
        np.testing.assert_array_equal(a, b)
    full, micro = out_full[2], out_micro[2]
    np.testing.assert_allclose(float(micro["learning_rate"]), 1e-2, rtol=1e-6)

    assert float(full["num_target_tokens"]) == float(micro["num_target_tokens"]) == float(host["loss_mask"].sum())
    np.testing.assert_allclose(micro["loss"], full["loss"], rtol=1e-6)
    np.testing.assert_allclose(micro["grad_norm"], full["grad_norm"], rtol=1e-5)
    mu_full, mu_micro = _first_moments(out_full[1]), _first_moments(out_micro[1])
    assert len(mu_full) == len(mu_micro) == len(jax.tree.leaves(lora))
    for g_full, g_micro in zip(mu_full, mu_micro):
        assert float(jnp.max(jnp.abs(g_full))) > 0
        np.testing.assert_allclose(g_micro, g_full, rtol=2e-5, atol=1e-9)
    # Adam's first update is ~lr * g / |g|: where |g| is near eps the direction is ill-conditioned, so the
    # updates are compared with an absolute tolerance of 0.1% of the learning rate.
    for a, b, p in zip(jax.tree.leaves(out_micro[0]), jax.tree.leaves(out_full[0]), jax.tree.leaves(lora)):
        np.testing.assert_allclose(a - p, b - p, rtol=0, atol=1e-5)

    # The test is sensitive: averaging per-micro-batch means (the naive accumulation) gives another loss.
    micro_sum = jax.jit(lambda lo, b: token_loss_sum(nnx.merge(graphdef, lo, frozen), b))  # one compile, not per op
    per_micro = [micro_sum(lora, {k: v[m * 2:(m + 1) * 2] for k, v in host.items()})
                 / host["loss_mask"][m * 2:(m + 1) * 2].sum() for m in range(4)]
    loss_full = float(full["loss"])
    assert abs(float(np.mean(per_micro)) - loss_full) > 1e-4 * loss_full  # 100x the tolerance above


def test_packed_loss_equals_unpacked_loss():
    """Four documents (512 tokens) packed in one row vs each alone in a padded row: same summed loss and count."""
    rs = np.random.RandomState(7)
    lengths = [200, 150, 100, 62]
    docs = [Document(rs.randint(4, CFG.vocab_size, n), rs.rand(n) < 0.7, f"doc{i}") for i, n in enumerate(lengths)]
    graphdef, lora, frozen = _lora_model(seed=1)
    model = nnx.merge(graphdef, lora, frozen)
    loss_fn = jax.jit(lambda b: (token_loss_sum(model, b), b["loss_mask"].sum()))

    packed = PackedDataset(docs, max_seq_length=512, batch_size=1, shuffle=False)
    assert packed.num_rows == 1
    packed_sum, packed_count = loss_fn(packed.batch(0))

    alone_sum, alone_count = 0.0, 0.0
    for doc in docs:  # each document alone, right-padded to the same 512 columns
        s, c = loss_fn(PackedDataset([doc], max_seq_length=512, batch_size=1, shuffle=False).batch(0))
        alone_sum, alone_count = alone_sum + float(s), alone_count + float(c)

    assert float(packed_count) == alone_count == sum(int(d.loss_mask[1:].sum()) for d in docs)
    np.testing.assert_allclose(float(packed_sum) / float(packed_count), alone_sum / alone_count, rtol=1e-5)


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup"])
@pytest.mark.parametrize("warmup", [0, 7])
def test_schedules_match_transformers(kind, warmup):
    import torch
    from transformers import get_scheduler

    total, lr = 50, 3e-4
    param = torch.nn.Parameter(torch.zeros(1))
    torch_opt = torch.optim.AdamW([param], lr=lr)
    sched = get_scheduler(kind, torch_opt, num_warmup_steps=warmup, num_training_steps=total)
    expected = []
    for _ in range(total + 3):  # past the end too (linear/cosine stay at 0)
        expected.append(torch_opt.param_groups[0]["lr"])
        torch_opt.step()
        sched.step()
    ours = make_schedule(kind, lr, total, warmup)  # "constant" ignores warmup, as in transformers
    got = [float(ours(jnp.asarray(s, jnp.int32))) for s in range(total + 3)]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-10)


def test_warmup_ratio_rounds_up_and_warmup_steps_win():
    assert warmup_steps_for(100, 0, 0.1) == 10
    assert warmup_steps_for(95, 0, 0.1) == 10  # ceil(9.5), as transformers' get_warmup_steps
    assert warmup_steps_for(100, 5, 0.1) == 5
    assert warmup_steps_for(100, 0, 0.0) == 0


def test_device_out_of_memory_becomes_a_one_line_config_error(tmp_path):
    from jaxft.train.config import TrainConfig, TrainConfigError
    from jaxft.train.loop import _out_of_memory

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    (tmp_path / "config.json").write_text("{}")  # the config only checks that the paths exist
    cfg = TrainConfig(model_name_or_path=str(tmp_path), dataset=str(data), output_dir=str(tmp_path / "o"),
                      max_seq_length=16384, per_device_train_batch_size=4)
    err = _out_of_memory(jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 124.88GiB\nmore detail"), cfg)
    assert isinstance(err, TrainConfigError)
    text = str(err)
    assert "124.88GiB" in text and "\n" not in text
    for needle in ("remat: offload", "per_device_train_batch_size (now 4)", "max_seq_length (now 16384)"):
        assert needle in text
    other = jax.errors.JaxRuntimeError("INTERNAL: something else")
    assert _out_of_memory(other, cfg) is other  # not an OOM: re-raised unchanged


def test_unstack_layers_gives_per_layer_buffers_and_restack_inverts_it():
    """unstack_layers makes per-layer weight buffers (the unrolled layers' layout), restack_layers inverts it
    exactly. (Their step is the same math as the scan over stacked weights, same loss and LoRA gradients:
    tests/test_remat.py::test_unrolled_layers_give_the_gradients_of_the_layer_scan, Gemma 2's alternating windows
    covering several layer runs; trained through `Run`: tests/test_run.py's unrolled variant.)"""
    from jaxft.models.decoder import is_unstacked
    from jaxft.train import restack_layers, unstack_layers

    cfg = dataclasses.replace(CFG, num_layers=3, layer_windows=(16, None, 16))
    model = init_model(cfg, dtype=jnp.float32, seed=0)
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"), seed=0)
    graphdef, lora, frozen = split_model(model)
    unstacked = unstack_layers(frozen)
    assert is_unstacked(nnx.split(nnx.merge(graphdef, lora, unstacked).layers)[1])
    assert not is_unstacked(nnx.split(nnx.merge(graphdef, lora, frozen).layers)[1])
    back = restack_layers(unstacked)
    for (pa, a), (pb, b) in zip(nnx.to_flat_state(frozen), nnx.to_flat_state(back)):
        assert pa == pb
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))
