"""`remat: auto` (Run.choose_remat): the choice follows max_memory_gb through the compiled estimates, its lines,
the one-line error when nothing fits, the CLI default; the tiled MLP (same numbers, less compiled memory) and
the cross-entropy chunk chosen by length."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxft.config import ModelConfig
from jaxft.memory.execution import ExecutionConfig, ExecutionConfigError
from jaxft.lora import LoraConfig
from jaxft.memory.policy import AUTO_ORDER, LEAN_ATTN, offloaded_bytes, parse, residual_bytes
from jaxft.memory import GIB, STREAMED, peak_estimate
from jaxft.memory.choice import host_fit
from jaxft.memory.streamed import is_packed as streamed_is_packed
from jaxft.run import Run
from jaxft.train.step import loss_and_grad_sums, stack_micro_batches
from test_remat import grads, lora_split, packed_batch
from test_train_fixtures import make_jsonl, make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("auto") / "model", hidden=64, layers=2)


def _batch():
    return packed_batch(64, b=2, t=128)


class LongRows(Run):
    """A run whose rows count as attending long enough for LEAN_ATTN's host copies to pay (`Target.copies_pay`),
    so that the tests of the budgets reach every candidate: the tiny model's 128-token rows never do, which
    `test_auto_tries_lean_attn_last_where_its_copies_cost_more_than_the_attention` tests on its own."""

    def _copies_pay(self, host_batch):
        return True, 1.0, 0.0


def _run(model_dir, remat, **execution):
    return LongRows(model_dir, lora_config=LoraConfig(r=4, alpha=8), dtype="float32",
                    execution=ExecutionConfig(attention_implementation="reference", remat=remat, **execution))


@pytest.fixture(scope="module")
def estimates(model_dir):
    out = {}
    for policy in AUTO_ORDER[:AUTO_ORDER.index("offload+attn") + 1]:
        run = _run(model_dir, policy)
        run.compile(_batch())
        out[policy] = peak_estimate(run.memory_analysis())
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


def test_nothing_fits_is_one_line_naming_the_key_and_the_smallest_estimate(model_dir):
    """Nothing fits: every candidate was compiled; one line names the smallest; the run's settings are as given and
    it does not load. (With frozen_weights auto, one device, the same candidates streamed from host memory too:
    test_memory_choice, over made-up compiles.)"""
    run = _run(model_dir, "auto", max_memory_gb=1e-4, frozen_weights="device")
    with pytest.raises(ExecutionConfigError) as info:
        run.choose_remat(_batch(), log=lambda line: None)
    text = str(info.value)
    smallest = min(run.trials.estimates, key=run.trials.estimates.get)
    assert set(run.trials.estimates) == set(AUTO_ORDER) and "\n" not in text
    assert text.startswith("key 'max_memory_gb': no remat policy fits in 0.000 GiB (max_memory_gb): the smallest "
                           f"estimate is {smallest} at {run.trials.estimates[smallest] / GIB:.3f} GiB")
    assert run.execution.remat == "auto" and run.execution.frozen_weights == "device" and run._compiled is None
    with pytest.raises(RuntimeError, match="choose_remat"):
        run.load()


class GpuAccounting(Run):
    """A run whose memory analysis leaves the streamed weights out of the device arguments, as XLA's GPU analysis
    does (pinned-host arguments are `host_argument_size_in_bytes` there); the CPU backend counts them as arguments,
    its device memory being the host's."""

    def memory_analysis(self):
        m = super().memory_analysis()
        if self.streams_weights and m:
            m = dict(m, argument_size_in_bytes=m["argument_size_in_bytes"] - self.streamed_weight_bytes())
        return m


def test_when_nothing_fits_on_the_device_auto_streams_the_weights(model_dir):
    """frozen_weights auto (the default), one device: no candidate fits with the weights on the device, the
    streamed offload+attn does: auto chooses it, says so, and the chosen step (weights packed in host memory) is
    the one that loads and steps."""
    def estimate(policy, weights):
        run = GpuAccounting(model_dir, lora_config=LoraConfig(r=4, alpha=8), dtype="float32",
                            execution=ExecutionConfig(attention_implementation="reference", remat=policy,
                                                      layer_loop="scan", frozen_weights=weights))
        run.compile(_batch())
        return peak_estimate(run.memory_analysis())

    on_device = min(estimate(p, "device") for p in AUTO_ORDER)
    streamed = estimate("offload+attn", "host")
    assert streamed < on_device  # the premise: streaming is what fits between the two
    lines = []
    run = GpuAccounting(model_dir, lora_config=LoraConfig(r=4, alpha=8), dtype="float32",
                        execution=ExecutionConfig(attention_implementation="reference", remat="auto",
                                                  max_memory_gb=(streamed + on_device) / 2 / GIB))
    assert run.choose_remat(_batch(), log=lines.append) == "offload+attn"
    assert run.execution.frozen_weights == "host" and run.streams_weights
    assert run.remat_choice == ("offload+attn" + STREAMED, streamed)
    assert any("no policy fits with the frozen weights on the device" in line for line in lines)
    assert lines[-2].startswith("remat auto: offload+attn (weights on host) estimated peak")
    assert lines[-2].endswith("fits: chosen")
    compiled = run._compiled
    run.load()
    assert streamed_is_packed(run.frozen)
    assert np.isfinite(float(run.step(_batch(), 0)["loss"])) and run._compiled is compiled


class HostResiduals(Run):
    """A run whose memory analysis leaves what its policy offloads out of the device temp, as XLA's GPU analysis
    does (pinned-host temps are `host_temp_size_in_bytes` there); the CPU backend keeps them with the rest."""

    def memory_analysis(self):
        m = super().memory_analysis()
        if m and self.execution.remat != "auto" and parse(self.execution.remat).offloads:
            rows, seq = _batch()["input_ids"].shape
            policy = self.execution.layer_policy(self.model_config, rows, seq, 4)
            m = dict(m, temp_size_in_bytes=m["temp_size_in_bytes"] - offloaded_bytes(
                policy, self.model_config, rows, seq, 4))
        return m


class LongHostResiduals(LongRows, HostResiduals):
    """HostResiduals whose rows count as long (`LongRows`)."""


def _host_estimate(model_dir, policy):
    run = HostResiduals(model_dir, lora_config=LoraConfig(r=4, alpha=8), dtype="float32",
                        execution=ExecutionConfig(attention_implementation="reference", remat=policy))
    run.compile(_batch())
    return peak_estimate(run.memory_analysis())


def test_auto_takes_the_attention_residuals_to_the_host_when_offload_attn_does_not_fit(model_dir):
    """offload+attn (the attention's residuals kept on the device) does not fit, the same recompute with them in
    pinned host memory does (LEAN_ATTN): auto chooses it without compiling full or offload, which recompute the
    attention forward too, and the chosen step is the one that loads and steps."""
    with_attn, lean = _host_estimate(model_dir, "offload+attn"), _host_estimate(model_dir, LEAN_ATTN)
    assert lean < with_attn < _host_estimate(model_dir, "none")  # the premise: LEAN_ATTN alone fits between the two
    lines = []
    run = LongHostResiduals(model_dir, lora_config=LoraConfig(r=4, alpha=8), dtype="float32",
                            execution=ExecutionConfig(attention_implementation="reference", remat="auto",
                                                      max_memory_gb=(lean + with_attn) / 2 / GIB))
    assert run.choose_remat(_batch(), log=lines.append) == LEAN_ATTN == run.execution.remat
    assert list(run.trials.estimates) == ["none", "offload+attn", LEAN_ATTN]
    assert run.remat_choice == (LEAN_ATTN, lean) and not run.streams_weights
    assert lines[-1] == f"remat auto: chose {LEAN_ATTN} (not compiled: full, offload, expected slower)"
    compiled = run._compiled
    run.load()
    assert np.isfinite(float(run.step(_batch(), 0)["loss"])) and run._compiled is compiled


def test_auto_tries_lean_attn_last_where_its_copies_cost_more_than_the_attention(model_dir):
    """The tiny model's packed 128-token rows attend a few dozen keys a query: LEAN_ATTN's copies of the attention
    output would cost more than the attention forward they spare (`jaxft.memory.policy.attention_copies_pay`), so auto
    tries full and offload, which recompute the attention, before it, and says why in one line. With the budget
    that chose LEAN_ATTN above (only it fits), it is still chosen, last."""
    with_attn, lean = _host_estimate(model_dir, "offload+attn"), _host_estimate(model_dir, LEAN_ATTN)
    lines = []
    run = HostResiduals(model_dir, lora_config=LoraConfig(r=4, alpha=8), dtype="float32",
                        execution=ExecutionConfig(attention_implementation="reference", remat="auto",
                                                  frozen_weights="device", max_memory_gb=(lean + with_attn) / 2 / GIB))
    order = ("none", "offload+attn", "full", "offload", LEAN_ATTN)
    assert run.choose_remat(_batch(), log=lines.append) == LEAN_ATTN == run.execution.remat
    assert tuple(run.trials.estimates) == order and run.remat_choice == (LEAN_ATTN, lean)
    assert lines[0].endswith("candidates in order of expected speed: " + ", ".join(order))
    assert lines[1].startswith(f"remat auto: {LEAN_ATTN} tried after offload: its attention copies to host cost ")
    assert lines[1].endswith(" TFLOP)") and "more than the attention forward they spare" in lines[1]


def test_attention_copies_pay_on_long_documents_only():
    """LEAN_ATTN's price on Llama-3.1-8B's shape (a config, no weights), bf16: one document of 16k or 64k tokens
    attends enough for its copies to pay (at 16k it was 3% faster than offload on the H200, docs/benchmarks.md
    section 38); one of 4k, or documents of ~300 tokens packed into 16k (a few hundred keys a query), do not;
    GPT-OSS-20B's packed row (16% slower than offload on an H100, section 41, with narrower cross-entropy chunks:
    section 43) does not either. The price is the
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
    cfg = TrainConfig(model_name_or_path=str(model_dir), dataset=str(tmp_path / "train.jsonl"),
                      output_dir=str(tmp_path / "out"), max_seq_length=64, per_device_train_batch_size=2,
                      max_steps=2, bf16=False, disable_tqdm=True, report_to="none")
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
def test_tiled_mlp_gives_the_untiled_numbers():
    """Chunks of 24 tokens over 64 (the last chunk padded): the MLP acts per token, so the loss and the LoRA
    gradients agree to fp32 rounding of the smaller matmuls and of dA/dB summed chunk by chunk."""
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    split = lora_split(cfg)
    for remat in ("none", "full"):
        want_loss, want = grads(cfg, split, remat, "scan")
        loss, got = grads(cfg, split, remat, "scan", mlp_chunk_size=24)
        assert abs(loss - want_loss) <= 1e-6 * abs(want_loss)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-6 * float(np.max(np.abs(w))))


TILED_KEEPERS = ("offload=layer_input,attn_out,mlp_gate_up", "save=attn_out,mlp_gate_up;offload=layer_input")


@pytest.mark.parametrize("remat", TILED_KEEPERS)
def test_a_tiled_mlp_keeps_no_gate_up_under_any_policy(remat):
    """Where the MLP is tiled its gate/up exist one chunk at a time inside the chunk loop: no policy keeps or
    offloads them (XLA 0.11.2 failed layout assignment for a host copy of them, compiled for an H200:
    docs/benchmarks.md section 18); the other names stay, and untiled (chunk >= T) nothing changes. Gradients
    with the tiled MLP equal the untiled no-remat ones; the host copies (lowered for CUDA) lose gate and up."""
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    untiled = ExecutionConfig(remat=remat).layer_policy(cfg, 1, 64, 4)
    assert untiled == ExecutionConfig(remat=remat, mlp_chunk_size=64).layer_policy(cfg, 1, 64, 4)
    assert "mlp_gate_up" in untiled.save + untiled.offload
    tiled = ExecutionConfig(remat=remat, mlp_chunk_size=24).layer_policy(cfg, 1, 64, 4)
    assert tiled == untiled.without(("mlp_gate_up",)) and tiled.save + tiled.offload
    assert "mlp_gate_up" not in tiled.save + tiled.offload

    split = lora_split(cfg)
    want_loss, want = grads(cfg, split, "none", "scan")
    loss, got = grads(cfg, split, remat, "scan", mlp_chunk_size=24)
    assert abs(loss - want_loss) <= 1e-6 * abs(want_loss)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-6 * float(np.max(np.abs(w))))

    def host_values(chunk):
        graphdef, lora, frozen = split
        batch = stack_micro_batches(packed_batch(cfg.vocab_size), 1)
        ex = ExecutionConfig(attention_implementation="reference", remat=remat, layer_loop="scan",
                             mlp_chunk_size=chunk)
        fn = jax.jit(lambda lo, fz, b: loss_and_grad_sums(graphdef, lo, fz, b, None, ex)[1])
        return fn.trace(lora, frozen, batch).lower(lowering_platforms=("cuda",)).as_text().count(
            '_xla_buffer_placement = "pinned_host"')

    if "mlp_gate_up" in untiled.offload:  # gate and up: two host copies fewer in the scan's one layer body
        assert host_values(24) == host_values(None) - 2 > 0


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
    # (docs/benchmarks.md section 43); elsewhere at least one 128-token tile.
    assert full.resolved_ce_chunk(16384, 201088, 2880, 2, "NVIDIA H100 80GB HBM3") == 256
    assert full.resolved_ce_chunk(16384, 201088, 2880, 2, "cpu") == 128
    assert ExecutionConfig(remat="none").resolved_ce_chunk(4096, 128256, 4096, 2) is None  # the kernel decides
    assert full.resolved_ce_chunk(4096, 128256, 4096, 2, "NVIDIA H200") == 256
    # MoE widths (GPT-OSS-20B, Qwen3-30B-A3B; Gemma's 256k vocabulary too): the cap of 4 layer inputs is below
    # 128 tokens, so the floor decides; 256 measured faster than 128 at the same peak (section 28).
    assert full.resolved_ce_chunk(4096, 201088, 2880, 2, "NVIDIA H200") == 256
    assert full.resolved_ce_chunk(4096, 151936, 2048, 2, "NVIDIA H200") == 256
    assert full.resolved_ce_chunk(65536, 128256, 4096, 2, "NVIDIA H200") == 512  # long rows: the byte budget
    assert ExecutionConfig(remat="full", ce_chunk_size=77).resolved_ce_chunk(4096, 128256, 4096, 2) == 77


def test_auto_checks_what_the_host_holds(model_dir, estimates):
    """A host budget below the layer inputs: offload+attn does not fit (host) and is not compiled, so the same
    device budget that chose it now gets the next candidate; offload itself becomes nested blocks sized to the
    host (remat_block auto) instead of a step that would run out of host memory."""
    full = _run(model_dir, "full")
    full.compile(_batch())
    below = max(estimates["offload+attn"], peak_estimate(full.memory_analysis()))
    assert estimates["none"] > below
    between = (estimates["none"] + below) / 2 / GIB  # offload+attn and full fit, none does not
    assert _run(model_dir, "auto", max_memory_gb=between).choose_remat(_batch(), log=lambda line: None) == \
        "offload+attn"
    stream = 2 * 128 * 64 * 4  # one fp32 layer input of the [2, 128] batch at hidden 64
    lines = []
    run = _run(model_dir, "auto", max_memory_gb=between, host_memory_gb=stream / GIB)
    assert run.choose_remat(_batch(), log=lines.append) == "full"
    assert "offload+attn" not in run.trials.estimates and LEAN_ATTN not in run.trials.estimates
    for policy in ("offload+attn", LEAN_ATTN):  # each skipped with its line, neither compiled
        assert any(line.startswith(f"remat auto: {policy} offloads ") and line.endswith("-> does not fit (host)")
                   for line in lines)
    nested = host_fit(run._target(), ExecutionConfig(remat="offload", host_memory_gb=stream / GIB), _batch(),
                      lines.append)
    assert nested.remat_block == "auto" and nested.layer_policy(run.model_config, 2, 128, 4).block == 2
    assert lines[-1].endswith("offload in nested blocks of 2 layers (remat_block auto)")
    roomy = ExecutionConfig(remat="offload", host_memory_gb=2 * stream / GIB)
    assert host_fit(run._target(), roomy, _batch(), lines.append) is roomy


def test_jaxft_claims_most_of_each_gpu_unless_told_otherwise():
    """`claim_gpu_memory` (called by jaxft.train.train, jaxft-generate and the benchmark's worker before anything
    touches a device) sets XLA_PYTHON_CLIENT_MEM_FRACTION to GPU_MEMORY_FRACTION, where JAX's own default would
    leave a quarter of each GPU unused; a value the environment sets stands; once JAX's backends have started it sets nothing (JAX
    reads the variable once). In fresh processes, since this one's backends have started."""
    import os
    import subprocess
    import sys

    from jaxft.memory import GPU_MEMORY_FRACTION

    # Claim before the backends start, start them, drop the variable, claim again.
    probe = ("import os, jax; from jaxft import claim_gpu_memory as claim; before = claim(); "
             "set_before = os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION']; jax.devices(); "
             "os.environ.pop('XLA_PYTHON_CLIENT_MEM_FRACTION'); print(before, set_before, claim())")
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}

    def run(code=probe, **extra):
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                             check=True)
        return out.stdout.split()

    want = f"{GPU_MEMORY_FRACTION:.2f}"
    assert run() == [want, want, "None"] and float(want) > 0.75
    assert run(XLA_PYTHON_CLIENT_MEM_FRACTION="0.5") == ["0.5", "0.5", "None"]
    # jaxft-generate claims the same share before it reads the model (a directory without config.json: exit 2).
    generate = ("import os; from jaxft.generate_cli import main; "
                "print(main(['/nonexistent-model-dir', '--prompt', 'x']), os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])")
    assert run(generate) == ["2", want]
