"""`remat: auto` (Run.choose_remat) and the allocator's re-choice after the load (Run.fit_allocator) over a Run's
real compiles: the choice follows max_memory_gb through the compiled estimates, its lines, the one-line error when
nothing fits, the CLI default; the candidates' order and the host check over made-up compiles (more of that logic:
test_memory_choice); the tiled MLP (same numbers, less compiled memory) and the cross-entropy chunk chosen by
length."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxft.config import ModelConfig
from jaxft.lora import LoraConfig
from jaxft.memory import GIB, Trials, choose_remat, peak_estimate
from jaxft.memory.choice import auto_order, fit_allocator, host_fit
from jaxft.memory.execution import ExecutionConfig, ExecutionConfigError
from jaxft.memory.policy import AUTO_ORDER, LAYER_INPUT, LEAN_ATTN, residual_bytes
from jaxft.run import Run
from jaxft.train.step import loss_and_grad_sums, stack_micro_batches
from test_memory_choice import PEAKS, _layered
from test_memory_choice import _batch as made_up_batch
from test_memory_choice import _compiler as made_up_compiler
from test_memory_choice import _target as made_up_target
from test_remat import LLAMA, grads, lora_split, packed_batch
from test_train_fixtures import make_jsonl, make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("auto") / "model", hidden=64, layers=2)


def _batch():
    return packed_batch(64, b=2, t=128)


class LongRows(Run):
    """A run whose rows count as attending long enough for LEAN_ATTN's host copies to pay (`Target.copies_pay`),
    so that the tests of the budgets reach every candidate in AUTO_ORDER: the tiny model's 128-token rows never do,
    which `test_auto_tries_lean_attn_last_where_its_copies_cost_more_than_the_attention` tests on its own."""

    def _copies_pay(self, host_batch):
        return True, 1.0, 0.0


def _run(model_dir, remat, **execution):
    """(total_steps 2: the CLI test's run, whose step for remat none is then this one's, from the compilation
    cache.)"""
    return LongRows(model_dir, lora_config=LoraConfig(r=4, alpha=8), dtype="float32", total_steps=2,
                    execution=ExecutionConfig(attention_implementation="reference", remat=remat, **execution))


@pytest.fixture(scope="module")
def analyses(model_dir):
    """policy -> the compiled memory analysis of the step, for the policies of AUTO_ORDER up to offload+attn."""
    out = {}
    for policy in AUTO_ORDER[:AUTO_ORDER.index("offload+attn") + 1]:
        run = _run(model_dir, policy)
        run.compile(_batch())
        out[policy] = run.memory_analysis()
    return out


@pytest.fixture(scope="module")
def estimates(analyses):
    out = {policy: peak_estimate(m) for policy, m in analyses.items()}
    assert out["none"] > out["offload+attn"] > 0
    return out


def test_the_choice_follows_the_budget(model_dir, estimates):
    lines = []
    roomy = _run(model_dir, "auto", max_memory_gb=2 * estimates["none"] / GIB)
    assert roomy.choose_remat(_batch(), log=lines.append) == "none"
    assert roomy.execution.remat == "none" and roomy.trials.estimates == {"none": estimates["none"]}
    assert lines[0].startswith("remat auto: device budget ") and "(max_memory_gb)" in lines[0]
    assert lines[1].startswith(f"remat auto: none         estimated peak {estimates['none'] / GIB:.3f} GiB")
    assert lines[1].endswith("-> fits: chosen")
    assert lines[2] == ("remat auto: chose none (not compiled: offload+attn, offload=layer_input,attn_out,attn_lse, "
                        "full, offload, expected slower)")

    lines.clear()
    between = (estimates["none"] + estimates["offload+attn"]) / 2 / GIB
    want = next(p for p in estimates if estimates[p] <= between * GIB)  # the first in AUTO_ORDER that fits
    tight = _run(model_dir, "auto", max_memory_gb=between)
    assert tight.choose_remat(_batch(), log=lines.append) == want != "none"
    assert tight.trials.estimates == {p: estimates[p] for p in AUTO_ORDER[:AUTO_ORDER.index(want) + 1]}
    assert lines[1].endswith("-> does not fit") and lines[len(tight.trials.estimates)].endswith("-> fits: chosen")
    # The chosen step stays compiled: loading and stepping reuse it.
    compiled = tight._compiled
    tight.load()
    assert np.isfinite(float(tight.step(_batch(), 0)["loss"])) and tight._compiled is compiled


class MadeUpCompiles(LongRows):
    """A run whose choices compile nothing: test_memory_choice's made-up callback (peaks by policy), so that a
    refusal's handling by `Run` is checked without compiling every candidate (the real compiles: the tests around)."""

    def _compiler(self, host_batch):
        return made_up_compiler([])


def test_nothing_fits_is_one_line_naming_the_key_and_the_smallest_estimate(model_dir):
    """Nothing fits: every candidate was compiled; one line names the smallest; the run's settings are as given and
    it does not load. (With frozen_weights auto, one device, the same candidates streamed from host memory too:
    test_memory_choice, over made-up compiles, as here.)"""
    run = MadeUpCompiles(model_dir, lora_config=LoraConfig(r=4, alpha=8), dtype="float32",
                         execution=ExecutionConfig(attention_implementation="reference", remat="auto",
                                                   max_memory_gb=1e-4, frozen_weights="device"))
    with pytest.raises(ExecutionConfigError) as info:
        run.choose_remat(_batch(), log=lambda line: None)
    text = str(info.value)
    smallest = min(run.trials.estimates, key=run.trials.estimates.get)
    assert set(run.trials.estimates) == set(AUTO_ORDER) and "\n" not in text
    assert smallest == "offload" and run.trials.estimates[smallest] == int(PEAKS["offload"] * GIB)
    assert text.startswith("key 'max_memory_gb': no remat policy fits in 0.000 GiB (max_memory_gb): the smallest "
                           f"estimate is {smallest} at {run.trials.estimates[smallest] / GIB:.3f} GiB")
    assert run.execution.remat == "auto" and run.execution.frozen_weights == "device" and run._compiled is None
    with pytest.raises(RuntimeError, match="choose_remat"):
        run.load()


def test_auto_tries_lean_attn_last_where_its_copies_cost_more_than_the_attention(model_dir):
    """The tiny model's packed 128-token rows attend a few dozen keys a query: LEAN_ATTN's copies of the attention
    output would cost more than the attention forward they spare (`jaxft.memory.policy.attention_copies_pay`), so auto
    tries full and offload, which recompute the attention, before it, and says why in one line; where only it fits,
    it is still chosen, last. The order over made-up compiles (test_memory_choice's callback); where the copies pay,
    LEAN_ATTN comes before full and offload, which are then not compiled:
    test_memory_choice::test_choose_remat_takes_the_first_candidate_that_fits_and_compiles_none_after_it."""
    plain = Run(model_dir, lora_config=LoraConfig(r=4, alpha=8), dtype="float32",
                execution=ExecutionConfig(attention_implementation="reference", remat="auto"))
    order = ("none", "offload+attn", "full", "offload", LEAN_ATTN)
    assert auto_order(plain._target(), _batch())[0] == order
    pays, saved, copies = plain._target().copies_pay(_batch())
    assert not pays and copies > saved > 0
    target = dataclasses.replace(made_up_target(), copies_pay=lambda batch: (False, 2e12, 3e12))
    calls, lines, trials = [], [], Trials()
    decision = choose_remat(target, ExecutionConfig(remat="auto", layer_loop="scan", max_memory_gb=2.1,
                                                    host_memory_gb=64, frozen_weights="device"),
                            made_up_batch(), made_up_compiler(calls, {**PEAKS, "full": 2.5, "offload": 2.2}),
                            trials=trials, log=lines.append)
    assert decision.execution.remat == LEAN_ATTN and tuple(trials.estimates) == order
    assert trials.choice(decision.execution) == (LEAN_ATTN, int(PEAKS[LEAN_ATTN] * GIB))
    assert lines[0].endswith("candidates in order of expected speed: " + ", ".join(order))
    assert lines[1] == (f"remat auto: {LEAN_ATTN} tried after offload: its attention copies to host cost about 3.0 "
                        "TFLOP of matmul time a step, more than the attention forward they spare (2.0 TFLOP)")


def test_attention_copies_pay_on_long_documents_only():
    """LEAN_ATTN's price on Llama-3.1-8B's shape (a config, no weights), bf16: one document of 16k or 64k tokens
    attends enough for its copies to pay (at 16k it was 3% faster than offload on the H200); one of 4k, or documents of ~300 tokens packed into 16k (a few hundred keys a query), do not;
    GPT-OSS-20B's packed row (16% slower than offload on an H100, with narrower cross-entropy chunks)
    does not either. The price is the
    definition: the attention term of `recompute_work` against the extra residuals' bytes at the host link."""
    import transformers
    from test_remat_layers import _llama_8b

    from jaxft.memory.policy import ATTN_LSE, ATTN_OUT, HOST_COPY_FLOPS_PER_BYTE, attention_copies_pay, recompute_work

    cfg = _llama_8b()
    packed = np.repeat(np.arange(1, 56), 300)[None, :16384]
    verdicts = {}
    for name, ids in [("4k", np.ones((1, 4096), np.int32)), ("16k", np.ones((1, 16384), np.int32)),
                      ("64k", np.ones((1, 65536), np.int32)), ("packed 16k", packed)]:
        pays, saved, copies = attention_copies_pay(cfg, ids, 2)
        sizes = residual_bytes(cfg, *ids.shape, 2)
        assert saved == sum(a for _, a in recompute_work(cfg, ids))
        assert copies == cfg.num_layers * (sizes[ATTN_OUT] + sizes[ATTN_LSE]) * HOST_COPY_FLOPS_PER_BYTE
        assert pays == (saved > copies)
        verdicts[name] = pays
    assert verdicts == {"4k": False, "16k": True, "64k": True, "packed 16k": False}
    gpt_oss = ModelConfig.from_hf(transformers.GptOssConfig(num_hidden_layers=24, num_local_experts=32).to_dict())
    assert not attention_copies_pay(gpt_oss, packed, 2)[0]


def test_auto_is_the_cli_default_and_reports_estimate_and_peak(model_dir, tmp_path, caplog):
    import logging

    from jaxft.train import TrainConfig, train

    make_jsonl(tmp_path / "train.jsonl", 24)
    # the LoRA, attention and row shape of `_run`'s steps: its step for remat none is `analyses`' (one compile)
    cfg = TrainConfig(model_name_or_path=str(model_dir), dataset=str(tmp_path / "train.jsonl"),
                      output_dir=str(tmp_path / "out"), max_seq_length=128, per_device_train_batch_size=2,
                      max_steps=2, bf16=False, disable_tqdm=True, report_to="none", lora_r=4, lora_alpha=8,
                      attention_implementation="reference")
    assert cfg.execution_config.remat == "auto" and cfg.execution_config.max_memory_gb is None
    with caplog.at_level(logging.INFO, logger="jaxft"):
        result = train(cfg)
    messages = [r.getMessage() for r in caplog.records]
    assert result.global_step == 2
    assert any(m.startswith("remat auto: device budget ") and "host available memory" in m for m in messages)
    assert any(m.startswith("remat auto: none ") and m.endswith("fits: chosen") for m in messages)
    assert any(m.startswith("remat auto: none estimated peak ") and m.endswith(
        "not measured (the CPU keeps no allocator statistics)") for m in messages)


# ---------------------------------------------------------------------------------------------- tiled MLP
TILED_KEEPERS = ("offload=layer_input,attn_out,mlp_gate_up", "save=attn_out,mlp_gate_up;offload=layer_input")


def test_tiled_mlp_gives_the_untiled_numbers_and_keeps_no_gate_up_under_any_policy():
    """Chunks of 24 tokens over 64 (the last chunk padded): the MLP acts per token, so the loss and the LoRA
    gradients agree with the untiled no-remat ones to fp32 rounding of the smaller matmuls, of dA/dB summed chunk
    by chunk and of the recompute (the chunk loop inside each layer's checkpoint, under a policy that names
    gate/up). Where the MLP is tiled its gate/up exist one chunk at a time inside the chunk loop: no policy keeps
    or offloads them (XLA 0.11.2 failed layout assignment for a host copy of them, compiled for an H200);
    the other names stay, and untiled (chunk >= T) nothing changes; the host
    copies (lowered for CUDA) lose gate and up."""
    cfg, split = LLAMA, lora_split(LLAMA)
    for remat in TILED_KEEPERS:
        untiled = ExecutionConfig(remat=remat).layer_policy(cfg, 1, 64, 4)
        assert untiled == ExecutionConfig(remat=remat, mlp_chunk_size=64).layer_policy(cfg, 1, 64, 4)
        assert "mlp_gate_up" in untiled.save + untiled.offload
        tiled = ExecutionConfig(remat=remat, mlp_chunk_size=24).layer_policy(cfg, 1, 64, 4)
        assert tiled == untiled.without(("mlp_gate_up",)) and tiled.save + tiled.offload
        assert "mlp_gate_up" not in tiled.save + tiled.offload

    want_loss, want = grads(cfg, split, "none", "scan")  # test_remat's no-remat program
    loss, got = grads(cfg, split, TILED_KEEPERS[0], "scan", mlp_chunk_size=24)
    assert abs(loss - want_loss) <= 1e-6 * abs(want_loss)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-6 * float(np.max(np.abs(w))))

    def host_values(chunk):
        graphdef, lora, frozen = split
        batch = stack_micro_batches(packed_batch(cfg.vocab_size), 1)
        ex = ExecutionConfig(attention_implementation="reference", remat=TILED_KEEPERS[0], layer_loop="scan",
                             mlp_chunk_size=chunk)
        fn = jax.jit(lambda lo, fz, b: loss_and_grad_sums(graphdef, lo, fz, b, None, ex)[1])
        return fn.trace(lora, frozen, batch).lower(lowering_platforms=("cuda",)).as_text().count(
            '_xla_buffer_placement = "pinned_host"')

    assert host_values(24) == host_values(None) - 2 > 0  # gate and up: two host copies fewer in the one layer body


def test_tiled_mlp_holds_one_chunk_of_intermediate_activations():
    """Compiled on CPU from shapes: with a wide MLP the step's temporaries shrink when the MLP is tiled (the
    [T, intermediate] gate/up/act tensors become [chunk, intermediate])."""
    from flax import nnx

    from jaxft.lora import apply_lora
    from jaxft.models.decoder import Decoder
    from jaxft.train.step import loss_and_grad_sums, split_model

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=2048, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=64)
    graphdef, lora, frozen = split_model(nnx.eval_shape(
        lambda: apply_lora(Decoder(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)), LoraConfig(r=4, alpha=8))))
    t = 1024
    batch = {k: jax.ShapeDtypeStruct((1, 1, t), jnp.float32 if k == "loss_mask" else jnp.int32)
             for k in ("input_ids", "targets", "loss_mask", "segment_ids", "positions")}

    def temp(chunk):
        ex = ExecutionConfig(attention_implementation="reference", remat="full", mlp_chunk_size=chunk)
        step = jax.jit(lambda lo, fz, b: loss_and_grad_sums(graphdef, lo, fz, b, None, ex)[1])
        return step.lower(lora, frozen, batch).compile().memory_analysis().temp_size_in_bytes

    untiled, tiled = temp(None), temp(128)
    one_intermediate = t * cfg.intermediate_size * 4  # one fp32 [T, intermediate] tensor: 8 MiB
    assert untiled - tiled > one_intermediate


def test_mlp_chunk_size_is_validated():
    with pytest.raises(ExecutionConfigError, match=r"^key 'mlp_chunk_size': value 0 must be an integer >= 1"):
        ExecutionConfig(mlp_chunk_size=0)


# ---------------------------------------------------------------------------------------------- CE chunk
def test_ce_chunk_follows_length_under_remat():
    full = ExecutionConfig(remat="full")
    # The cap: 4 layer inputs (4 x 1024 tokens x 64 x 4 bytes = 1 MiB) of fp32 logits over a 1024 vocabulary are
    # 256 tokens, below the kernel's byte-budget default (16384 tokens here) and the 1024 tokens.
    assert full.resolved_ce_chunk(1024, 1024, 64, 4) == 256
    assert full.resolved_ce_chunk(4096, 1024, 64, 4) == 1024  # 4x the tokens, 4x the chunk
    assert full.resolved_ce_chunk(64, 1000, 32, 4) == 64  # short rows: the floor of 256, then at most the tokens
    # 8B widths, bf16, 1 x 4096: the cap is 256 tokens of a 128k vocabulary (the lean mode's measured choice);
    # off the H200 and the H100 the kernel's smaller default (64 MiB = 128 tokens) wins.
    assert full.resolved_ce_chunk(4096, 128256, 4096, 2, "cpu") == 128
    assert full.resolved_ce_chunk(4096, 128256, 4096, 2, "NVIDIA H100 80GB HBM3") == 256
    # GPT-OSS-20B packed 1 x 16384 on an H100: the lean mode's 256, not the conservative budget's 83 tokens
    # elsewhere at least one 128-token tile.
    assert full.resolved_ce_chunk(16384, 201088, 2880, 2, "NVIDIA H100 80GB HBM3") == 256
    assert full.resolved_ce_chunk(16384, 201088, 2880, 2, "cpu") == 128
    assert ExecutionConfig(remat="none").resolved_ce_chunk(4096, 128256, 4096, 2) is None  # the kernel decides
    assert full.resolved_ce_chunk(4096, 128256, 4096, 2, "NVIDIA H200") == 256
    # MoE widths (GPT-OSS-20B, Qwen3-30B-A3B; Gemma's 256k vocabulary too): the cap of 4 layer inputs is below
    # 128 tokens, so the floor decides; 256 measured faster than 128 at the same peak.
    assert full.resolved_ce_chunk(4096, 201088, 2880, 2, "NVIDIA H200") == 256
    assert full.resolved_ce_chunk(4096, 151936, 2048, 2, "NVIDIA H200") == 256
    assert full.resolved_ce_chunk(65536, 128256, 4096, 2, "NVIDIA H200") == 512  # long rows: the byte budget
    assert ExecutionConfig(remat="full", ce_chunk_size=77).resolved_ce_chunk(4096, 128256, 4096, 2) == 77


def test_auto_checks_what_the_host_holds():
    """A host budget below the layer inputs: offload+attn does not fit (host) and is not compiled, so the same
    device budget that chose it now gets the next candidate; offload itself becomes nested blocks sized to the
    host (remat_block auto) instead of a step that would run out of host memory. Over made-up compiles
    (test_memory_choice's callback) on a 2-layer model."""
    target, rows = dataclasses.replace(made_up_target(), model_config=_layered(2)), made_up_batch()
    stream = residual_bytes(target.model_config, 2, 64, 4)[LAYER_INPUT]  # one fp32 layer input of the batch
    assert stream == 2 * 64 * 64 * 4
    between = (PEAKS["none"] + PEAKS["offload+attn"]) / 2  # offload+attn and full fit, none does not

    def auto(**execution):
        lines, trials = [], Trials()
        ex = ExecutionConfig(remat="auto", layer_loop="scan", max_memory_gb=between, frozen_weights="device",
                             **execution)
        return choose_remat(target, ex, rows, made_up_compiler([]), trials=trials, log=lines.append), trials, lines

    assert auto(host_memory_gb=64)[0].execution.remat == "offload+attn"
    decision, trials, lines = auto(host_memory_gb=stream / GIB)
    assert decision.execution.remat == "full" and list(trials.estimates) == ["none", "full"]
    for policy in ("offload+attn", LEAN_ATTN):  # each skipped with its line, neither compiled
        assert any(line.startswith(f"remat auto: {policy} offloads ") and line.endswith("-> does not fit (host)")
                   for line in lines)
    nested = host_fit(target, ExecutionConfig(remat="offload", host_memory_gb=stream / GIB), rows, lines.append)
    assert nested.remat_block == "auto" and nested.layer_policy(target.model_config, 2, 64, 4).block == 2
    assert lines[-1].endswith("offload in nested blocks of 2 layers (remat_block auto)")
    roomy = ExecutionConfig(remat="offload", host_memory_gb=2 * stream / GIB)
    assert host_fit(target, roomy, rows, lines.append) is roomy


# ---------------------------------------------------------------------------------------- the allocator after load
def _stats(room: int) -> dict[str, int]:
    """memory_stats() of an allocator whose pool leaves `room` bytes below its limit and has no larger free block
    (as a GPU's after loading weights with XLA_PYTHON_CLIENT_PREALLOCATE=false)."""
    return {"bytes_limit": 10 * GIB, "pool_bytes": 10 * GIB - room, "largest_free_block_bytes": room // 2}


def test_fit_allocator_in_the_layer_scan_takes_the_next_scan_policy_whose_temp_fits(model_dir, analyses):
    """auto over the layer scan chose no remat; after the load the pool leaves less room than its temp but more
    than offload+attn's: offload+attn is compiled over the stacked weights as placed and kept, and the step runs.
    (With room for none of them: the next test, over made-up compiles. The over-unrolled-layers re-choice:
    test_remat_layers, over made-up compiles; the steps here are those of the tests above, compiled once for all
    through the run's compilation cache.)"""
    temps = {policy: m["temp_size_in_bytes"] for policy, m in analyses.items()}
    assert temps["none"] > temps["offload+attn"] > 0
    lines = []
    run = _run(model_dir, "auto", layer_loop="scan", max_memory_gb=1000.0)
    assert run.choose_remat(_batch(), log=lines.append) == "none" and not run.unrolled
    run.load()
    room = (temps["none"] + temps["offload+attn"]) // 2
    run.fit_allocator(_batch(), stats=_stats(room), log=lines.append)
    assert (run.execution.remat, run.execution.remat_layers, run.unrolled) == ("offload+attn", None, False)
    assert run.memory_analysis()["temp_size_in_bytes"] == temps["offload+attn"] <= room
    assert lines[-1].startswith("remat auto: offload+attn temp ") and lines[-1].endswith("fits the allocator: chosen")
    assert run.remat_choice == ("offload+attn", run.trials.estimates["offload+attn"])
    assert np.isfinite(float(run.step(_batch(), 0)["loss"]))


def test_fit_allocator_with_room_for_no_later_scan_policy_is_one_line_on_the_key():
    """With room for none of them, each later scan policy is compiled once (made-up compiles, test_memory_choice's
    callback: the real ones are the test above's), then the one-line error on the key."""
    calls, lines = [], []
    trials = Trials(estimates={p: int(PEAKS[p] * GIB) for p in AUTO_ORDER[:2]})
    chosen = ExecutionConfig(remat="offload+attn", layer_loop="scan", max_memory_gb=1000.0, host_memory_gb=64,
                             frozen_weights="device")
    with pytest.raises(ExecutionConfigError) as info:
        fit_allocator(made_up_target(), chosen, made_up_batch(), {"temp_size_in_bytes": int(3 * GIB)}, _stats(1024),
                      made_up_compiler(calls), trials=trials, log=lines.append)
    assert [c[0] for c in calls] == list(AUTO_ORDER[2:])
    assert all(line.endswith("does not fit the allocator") for line in lines[-2:])
    assert info.value.field == "max_memory_gb" and "\n" not in str(info.value)


def test_fit_allocator_names_the_fix_when_the_step_cannot_be_rechosen(model_dir):
    """A policy the user set (not auto): its temp does not fit the pool's room -> one line on key max_memory_gb
    with the numbers and the fixes, instead of the allocator's out-of-memory at the first step."""
    run = _run(model_dir, "none", layer_loop="scan")
    run.compile(_batch())
    run.load()
    with pytest.raises(ExecutionConfigError) as info:
        run.fit_allocator(_batch(), stats=_stats(1024))
    text = str(info.value)
    assert text.startswith("key 'max_memory_gb': after the load the allocator can place one buffer of 0.000 GiB "
                           "(pool 10.000 GiB of its 10.000 GiB limit") and "\n" not in text
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=true" in text and "below the step's temp" in text
    with pytest.raises(RuntimeError, match="before Run.load"):
        _run(model_dir, "none").fit_allocator(_batch(), stats=_stats(1024))


def test_jaxft_claims_most_of_each_gpu_unless_told_otherwise():
    """`claim_gpu_memory` (called by jaxft.train.train, jaxft-generate and the benchmark's worker before anything
    touches a device) sets XLA_PYTHON_CLIENT_MEM_FRACTION to GPU_MEMORY_FRACTION, where JAX's own default would
    leave a quarter of each GPU unused; a value the environment sets stands; once JAX's backends have started it sets nothing (JAX
    reads the variable once). Before the backends start: in a fresh process, since this one's have started."""
    import os
    import subprocess
    import sys

    from jaxft.memory import GPU_MEMORY_FRACTION

    # jaxft-generate claims the share before it reads the model (a directory without config.json: exit 2); then,
    # the variable dropped: claim before the backends start, start them, drop the variable, claim again.
    probe = ("import os, jax; from jaxft import claim_gpu_memory as claim; from jaxft.generate_cli import main; "
             "code = main(['/nonexistent-model-dir', '--prompt', 'x']); "
             "generated = os.environ.pop('XLA_PYTHON_CLIENT_MEM_FRACTION'); before = claim(); "
             "set_before = os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION']; jax.devices(); "
             "os.environ.pop('XLA_PYTHON_CLIENT_MEM_FRACTION'); print(code, generated, before, set_before, claim())")
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)

    want = f"{GPU_MEMORY_FRACTION:.2f}"
    assert out.stdout.split() == ["2", want, want, want, "None"] and float(want) > 0.75
    # A value the environment sets stands (before the backends start or after: here they have).
    from jaxft import claim_gpu_memory

    jax.devices()
    environ = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    assert claim_gpu_memory(environ) == "0.5" and environ == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    assert claim_gpu_memory({}) is None
