"""Nested checkpointing (`remat_block`, jaxft.memory.policy): blocks of k layers keep only their input (on the device
for remat full, in pinned host memory for offload), each layer inside a full checkpoint. Gradients equal to one
checkpoint per layer (Llama with a partial last block, Gemma 2's periodic scan, a Qwen3-MoE stack carrying router
statistics), one host copy per block in the CUDA-lowered program, the block size chosen for
a host budget, the host bytes the max-context search counts, and one-line errors for settings that cannot nest.
The device side (host bytes halved, compiled for the GPU) is tests/test_remat_gpu.py's."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from jaxft.config import ModelConfig
from jaxft.memory.execution import ExecutionConfig, ExecutionConfigError
from jaxft.memory.policy import (LAYER_INPUT, RematPolicy, block_layers, default_host_budget, offloaded_bytes,
                         residual_bytes)
from jaxft.train.step import loss_and_grad_sums, stack_micro_batches
from test_remat import GEMMA, grads, llama, lora_split, packed_batch

LLAMA5 = llama(5)  # blocks of 2: two whole blocks and a last block of one layer
GEMMA4 = dataclasses.replace(GEMMA, num_layers=4, layer_windows=(24, None) * 2)  # a period of 2: blocks of periods
MOE = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                  num_heads=2, num_kv_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=16)


@pytest.fixture(scope="module")
def one_per_layer():
    """family -> (config, split model, (loss, gradients) of one full checkpoint per layer), each made once."""
    cases = {}

    def case(family: str):
        if family not in cases:
            cfg = {"llama": LLAMA5, "gemma2": GEMMA4, "qwen3_moe": MOE}[family]
            split = lora_split(cfg)
            cases[family] = cfg, split, grads(cfg, split, "full", "scan")
        return cases[family]
    return case


# Each nesting policy once (the outer scan, the inner one and the last block are the same for either policy): offload
# on Llama (5 layers in blocks of 3+2: a partial last block) and Gemma 2's periods, full on a Qwen3-MoE stack of 3 in
# blocks of 2+1 (the router statistics carried through both block loops; a dense stack beside it nests as Llama's).
@pytest.mark.parametrize("family, remat, block", [("llama", "offload", 3), ("gemma2", "offload", 3),
                                                  ("qwen3_moe", "full", 2)])
def test_nested_blocks_give_the_gradients_of_one_checkpoint_per_layer(one_per_layer, family, remat, block):
    """fp32, packed rows. The block's recompute repeats its layers' forward on the same values; XLA fuses the
    nested program differently, so a few fp32 sums may round in another order: 2e-6 of each gradient's largest
    entry (measured: 0 to 5.7e-7)."""
    cfg, split, (want_loss, want_grads) = one_per_layer(family)
    loss, got = grads(cfg, split, remat, "scan", remat_block=block)
    assert len(got) == len(want_grads) > 0
    assert abs(loss - want_loss) <= 1e-6 * abs(want_loss)
    for g, w in zip(got, want_grads):
        scale = float(np.max(np.abs(w)))
        assert scale > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-6 * scale)


@functools.cache
def _llama5_split():
    return lora_split(LLAMA5)


def _placements(remat: str, block: int | None) -> tuple[int, int, int]:
    cfg = LLAMA5
    graphdef, lora, frozen = _llama5_split()
    batch = stack_micro_batches(packed_batch(cfg.vocab_size), 1)
    ex = ExecutionConfig(attention_implementation="reference", remat=remat, remat_block=block, layer_loop="scan")
    fn = jax.jit(lambda lo, fz, b: loss_and_grad_sums(graphdef, lo, fz, b, None, ex)[1])
    hlo = fn.trace(lora, frozen, batch).lower(lowering_platforms=("cuda",)).as_text()
    return (hlo.count('_xla_buffer_placement = "pinned_host"'), hlo.count('_xla_buffer_placement = "device"'),
            hlo.count("stablehlo.while"))


def test_each_block_copies_its_input_to_the_host_once():
    """Lowered for a GPU: plain offload copies the scan body's layer input (one placement); blocks of 2 over 5
    layers copy in the outer scan's body and in the last, partial block (two), a block of all 5 layers once;
    remat full with blocks copies nothing. Nesting adds the inner scans (more while loops)."""
    host, back, loops = _placements("offload", None)
    assert (host, back) == (1, 1)
    nested = _placements("offload", 2)
    assert nested[:2] == (2, 2) and nested[2] > loops
    assert _placements("offload", 5)[:2] == (1, 1)
    assert _placements("full", 2)[:2] == (0, 0)


def test_the_block_size_fits_the_host_budget():
    stream = residual_bytes(LLAMA5, 1, 1024, 2)[LAYER_INPUT]
    assert block_layers(32, 7, 32 * 7) == 1  # every layer input fits: no nesting
    assert block_layers(32, 7, 16 * 7) == 2 and block_layers(32, 7, 16 * 7 - 1) == 3  # ceil(32 / 3) = 11 inputs
    assert block_layers(32, 7, 3) == 32  # not even one input: the largest block (the step then says so itself)
    assert block_layers(32, 7, None) == 6 and block_layers(5, 7, None) == 3  # no budget: ceil(sqrt(L))
    ex = ExecutionConfig(remat="offload", remat_block="auto", host_memory_gb=2 * stream / 2**30)
    policy = ex.layer_policy(LLAMA5, 1, 1024, 2)
    assert policy.block == 3 and policy.offload == (LAYER_INPUT,)  # ceil(5 / 3) = 2 block inputs
    assert offloaded_bytes(policy, LLAMA5, 1, 1024, 2) == 2 * stream
    assert offloaded_bytes(dataclasses.replace(policy, block=1), LLAMA5, 1, 1024, 2) == 5 * stream
    assert ExecutionConfig(remat="full", remat_block="auto").layer_policy(LLAMA5, 1, 1024, 2).block == 3
    assert ExecutionConfig(remat="full", remat_block=9).layer_policy(LLAMA5, 1, 1024, 2).block == 5  # at most L
    assert ExecutionConfig(remat="offload").layer_policy(LLAMA5, 1, 1024, 2).block == 1
    # No host_memory_gb: the machine's memory less max(8 GiB, 10%).
    assert default_host_budget(128 * 2**30) == int(128 * 2**30 * 0.9)
    assert default_host_budget(40 * 2**30) == 32 * 2**30
    big = ExecutionConfig(remat="offload", remat_block="auto").layer_policy(LLAMA5, 1, 1024, 2)
    assert big.block == block_layers(5, stream, default_host_budget()) == 1


def test_only_full_and_offload_nest():
    assert RematPolicy("full").nested() == (RematPolicy("full"), RematPolicy("full"))
    outer, inner = RematPolicy("names", offload=(LAYER_INPUT,)).nested()
    assert outer.offload == ("block_input",) and not outer.save and inner == RematPolicy("full")
    with pytest.raises(ValueError, match="does not nest"):
        RematPolicy("names", save=("attn_out",), offload=(LAYER_INPUT,)).nested()


@pytest.mark.parametrize("settings, needle", [
    (dict(remat="offload", remat_block=0), "key 'remat_block': value 0 must be an integer >= 1, 'auto' or null"),
    (dict(remat="offload", remat_block="most"), "value 'most' must be an integer >= 1"),
    (dict(remat="offload", remat_block=True), "value True must be an integer >= 1"),
    (dict(remat="offload+attn", remat_block=2), "remat is 'offload+attn': nested blocks keep the layer input alone"),
    (dict(remat="none", remat_block="auto"), "set remat: full or offload, or drop remat_block"),
    (dict(remat="full", remat_block=2, layer_loop="unroll"), "needs the layer scan"),
    (dict(remat="offload", remat_block=2, offload_transfer="explicit"), "not 'explicit'"),
])
def test_settings_that_cannot_nest_get_one_line(settings, needle):
    with pytest.raises(ExecutionConfigError) as e:
        ExecutionConfig(**settings)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert e.value.field == "remat_block"


def test_remat_block_is_a_flat_key_of_the_recipe(tmp_path):
    from jaxft.train import TrainConfigError, load_config
    from test_train_fixtures import make_jsonl, make_tiny_model

    model = make_tiny_model(tmp_path / "m", hidden=32, layers=1)
    make_jsonl(tmp_path / "d.jsonl", 4)
    path = tmp_path / "run.yaml"
    head = f"model_name_or_path: {model}\ndataset: {tmp_path / 'd.jsonl'}\noutput_dir: {tmp_path / 'o'}\n"
    path.write_text(head + "remat: offload\nremat_block: auto\n")
    assert load_config(path).execution_config.remat_block == "auto"
    path.write_text(head + "remat: offload+attn\nremat_block: 2\n")
    with pytest.raises(TrainConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}:5: key 'remat_block': is set (2) but remat is 'offload+attn'")


def test_the_plan_of_a_run_states_its_blocks_and_what_streams(tmp_path):
    """What jaxft-train logs before its first step (`Run.describe`) on the tiny 3-layer Llama (fp32): under remat
    offload in blocks of 2 (a whole block and a partial one), the blocks and where their inputs go; with
    `frozen_weights: host`, 3 layers of q, o 32 x 32, k, v 32 x 16 and gate, up, down 32 x 64 / 64 x 32: 3 x 9,216 x
    4 bytes = 0.11 MiB in one packed buffer, each layer's 0.04 MiB copied one layer ahead, forward and backward.
    Their steps' numbers: test_nested_blocks_give_the_gradients_of_one_checkpoint_per_layer, and a Run over streamed
    weights training to the device run's losses,
    test_frozen_weights_host::test_the_run_packs_the_layer_weights_into_one_host_buffer."""
    from jaxft.run import Run
    from test_train_fixtures import tiny_run_config

    def plan(name, **values):
        run = Run.from_config(tiny_run_config(tmp_path, name, remat="offload", **values), total_steps=3)
        return "\n".join(line for _, line in run.describe(2, 64))

    nested = plan("nested", remat_block=2)
    assert "remat offload in nested blocks of 2 layers (remat_block 2): 2 block inputs" in nested
    assert "in pinned host memory" in nested
    streamed = plan("host", frozen_weights="host")
    assert ("frozen_weights host: 0.11 MiB of layer weights in pinned host memory (1 packed buffers), each layer's "
            "0.04 MiB copied to the device one layer ahead" in streamed)
    assert "(0.21 MiB over the host link per step)" in streamed


def test_nested_blocks_compile_without_pipelined_host_offload():
    """`ExecutionConfig.program_options`: XLA's pipelined host offloading peels the loop and held a second copy of
    a block's stacked layer inputs (compiled for an H200), so nested blocks go without it; one checkpoint per
    layer (remat_block 1 or none) keeps it; the user's compiler_options still win."""
    flag = "xla_gpu_enable_pipelined_host_offloading"
    assert flag not in ExecutionConfig(remat="offload", remat_block=2).program_options
    assert flag not in ExecutionConfig(remat="offload", remat_block="auto").program_options
    assert ExecutionConfig(remat="offload", remat_block=1).program_options == {flag: True,
                                                                                "xla_gpu_enable_command_buffer": ""}
    mine = ExecutionConfig(remat="offload", remat_block=2, compiler_options={flag: True})
    assert mine.program_options == {flag: True}
