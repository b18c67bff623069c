"""`jaxft.run.Run`, the one recipe: compiling from shapes before the weights load is the same program as
compiling after; variants over the same weights agree; the benchmark modes are jaxft-train recipes."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from jaxft.memory.execution import MEMORY_PRESETS, ExecutionConfig
from jaxft.lora import LoraConfig
from jaxft.run import Run
from jaxft.train import load_config, train
from jaxft.train.optim import OptimConfig
from test_train_fixtures import make_jsonl, make_tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("run") / "model", hidden=64, layers=2)


def _batches(n: int, b: int = 2, t: int = 64, vocab: int = 64):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        ids = rng.integers(0, vocab, (b, t)).astype(np.int32)
        seg = np.ones((b, t), np.int32)
        seg[:, t // 2:] = 2  # two documents per row
        pos = np.concatenate([np.arange(t // 2), np.arange(t - t // 2)])[None].repeat(b, 0).astype(np.int32)
        mask = np.ones((b, t), np.float32)
        mask[:, t // 2 - 1] = mask[:, -1] = 0
        out.append(dict(input_ids=ids, targets=np.roll(ids, -1, 1), loss_mask=mask, segment_ids=seg, positions=pos))
    return out


def _run(model_dir, **execution):
    return Run(model_dir, lora_config=LoraConfig(r=4, alpha=8), dtype="float32", total_steps=3,
               execution=ExecutionConfig(attention_implementation="reference", **execution),
               optim=OptimConfig(learning_rate=1e-2, lr_scheduler_type="constant", max_grad_norm=0.0))


def _losses(run, batches):
    return [float(run.step(b, i)["loss"]) for i, b in enumerate(batches)]


@pytest.fixture(scope="module")
def base(model_dir):
    """A run whose step was compiled from shapes before its weights loaded, that program, the run's first LoRA
    factors, and the losses of 3 steps of a variant of it from those factors (its step compiled after the load) on
    one batch three times."""
    run = _run(model_dir)
    compiled = run.compile(_batches(1)[0])  # nothing loaded yet: compiled from the abstract state
    assert not run.loaded and compiled.memory_analysis().temp_size_in_bytes > 0
    run.load()
    lora0 = jax.device_get(run.lora)
    return run, compiled, lora0, _losses(run.variant(run.execution, lora=lora0), _batches(1) * 3)


def test_compiling_from_shapes_before_loading_gives_the_same_steps(base):
    run, compiled, _, want = base
    got = _losses(run, _batches(1) * 3)
    assert run._compiled is compiled  # the early program ran every step (no recompilation)
    np.testing.assert_array_equal(got, want)
    assert want[2] < want[0]  # lr 1e-2 on a repeated batch: the steps train


def test_a_variant_with_another_remat_policy_and_loss_agrees(base):
    """One variant changes the remat policy and the loss (chunked cross-entropy) at once: one program; the layer
    loop (the weights unstacked) is the next test's variant, which also exports."""
    run, _, lora0, want = base
    other = run.variant(run.execution.replace(remat="offload", ce_chunk_size=16), lora=lora0)
    assert (other.execution.remat, other.execution.ce_chunk_size) == ("offload", 16)
    np.testing.assert_allclose(_losses(other, _batches(1) * 3), want, rtol=2e-5)


def test_unrolled_variant_agrees_and_its_export_loads_as_the_trained_model(base, model_dir, tmp_path):
    import jaxft

    run, _, lora0, want = base
    unrolled = run.variant(run.execution.replace(layer_loop="unroll"), lora=lora0)
    np.testing.assert_allclose(_losses(unrolled, _batches(1) * 3), want, rtol=2e-5)
    ids = _batches(1)[0]["input_ids"]
    logits = np.asarray(unrolled.model()(ids))
    unrolled.export_adapter(tmp_path / "adapter")  # per-layer weights stacked back for the export
    got = jaxft.load_adapter(jaxft.from_pretrained(model_dir, dtype="float32"), tmp_path / "adapter")(ids)
    np.testing.assert_allclose(np.asarray(got), logits, rtol=1e-5, atol=1e-5)


def test_bench_recipes_use_the_peers_lora_and_optimizer():
    from scripts.bench.harness import WORKER
    from scripts.bench.jaxft_worker import MODES, system_mode
    from scripts.bench.workloads import ADAMW, LORA

    assert [system_mode(s) for s in WORKER if s.startswith("jaxft")] == list(MODES)
    for mode in MODES:
        cfg = load_config(REPO / "examples/bench" / f"{mode}.yaml")
        if cfg.lora.finetuning_type == "lora":  # (full.yaml trains every weight)
            lora = cfg.lora_config
            assert (lora.r, lora.alpha, lora.dropout) == (LORA.r, LORA.alpha, LORA.dropout)
            assert lora.target_modules == tuple(sorted(LORA.targets))
        o = cfg.optim_config
        assert (o.learning_rate, o.adam_beta1, o.adam_beta2, o.adam_epsilon, o.weight_decay) == (
            ADAMW.lr, ADAMW.b1, ADAMW.b2, ADAMW.eps, ADAMW.weight_decay)
        assert o.lr_scheduler_type == "constant" and o.max_grad_norm == 0.0
    lean = load_config(REPO / "examples/bench/lean.yaml").execution_config
    assert (lean.remat, lean.resolved_layer_loop, lean.ce_chunk_size) == ("offload", "scan", 256)
    assert load_config(REPO / "examples/bench/lean_host.yaml").execution_config == lean.replace(frozen_weights="host")
    offload_attn = load_config(REPO / "examples/bench/offload_attn.yaml").execution_config
    assert load_config(REPO / "examples/bench/offload_attn_host.yaml").execution_config == offload_attn.replace(
        frozen_weights="host")
    lean_attn = offload_attn.replace(remat="offload=layer_input,attn_out,attn_lse")
    assert load_config(REPO / "examples/bench/lean_attn.yaml").execution_config == lean_attn
    assert load_config(REPO / "examples/bench/lean_attn_host.yaml").execution_config == lean_attn.replace(
        frozen_weights="host")
    fast = load_config(REPO / "examples/bench/fast.yaml").execution_config
    assert (fast.remat, fast.resolved_layer_loop) == ("none", "unroll")
    assert load_config(REPO / "examples/bench/fast_host.yaml").execution_config == fast.replace(layer_loop="scan",
                                                                                          frozen_weights="host")
    policies = {mode: load_config(REPO / "examples/bench" / f"{mode}.yaml").execution_config for mode in MODES}
    assert (policies["offload_attn"].remat, policies["auto"].remat) == ("offload+attn", "auto")
    assert (policies["auto_40gb"].remat, policies["auto_40gb"].max_memory_gb) == ("auto", 37.25)
    # each preset is the measured recipe it names (jaxft.memory.execution.MEMORY_PRESETS)
    for preset, mode in (("fast", "fast"), ("balanced", "offload_attn"), ("lean", "lean"),
                         ("max_context", "lean_attn_host"), ("auto", "auto")):
        assert load_config(REPO / "examples/bench" / f"{mode}.yaml").memory.memory == preset
        assert policies[mode] == ExecutionConfig(**MEMORY_PRESETS[preset])
    qlora = load_config(REPO / "examples/bench/qlora.yaml")
    assert (qlora.quant_config.quant_type, qlora.quant_config.double_quant) == ("nf4", True)
    assert qlora.execution_config == fast
    qlora_lean = load_config(REPO / "examples/bench/qlora_lean.yaml")
    assert (qlora_lean.quant_config, qlora_lean.execution_config) == (qlora.quant_config, policies["full_remat"])
    qlora_offload = load_config(REPO / "examples/bench/qlora_offload.yaml")
    assert (qlora_offload.quant_config, qlora_offload.execution_config) == (
        qlora.quant_config, policies["offload_unroll"].replace(ce_chunk_size=256))
    assert policies["offload_unroll"].resolved_layer_loop == "unroll"


# The other recipes are these settings combined (the test above checks how). One recipe per mechanism: named
# residuals to the host over weights streamed from the host (the streaming of fast_host, the scan with offload of
# lean), a 4-bit base unrolled with offload and chunked CE (lean's chunked CE). (offload_attn's policy, attention
# residuals kept, trains over streamed weights in test_frozen_weights_host.)
@pytest.mark.parametrize("mode", ["lean_attn_host", "qlora_offload"])
def test_bench_recipes_run_in_jaxft_train(mode, model_dir, tmp_path):
    make_jsonl(tmp_path / "train.jsonl", 40)
    cfg = load_config(REPO / "examples/bench" / f"{mode}.yaml", [
        f"model_name_or_path={model_dir}", f"dataset={tmp_path / 'train.jsonl'}", f"output_dir={tmp_path / 'out'}",
        "max_seq_length=128", "max_steps=2", "bf16=false", "disable_tqdm=true"])
    result = train(cfg)
    assert result.global_step == 2 and np.isfinite(result.train_loss)
    assert (result.adapter_dir / "adapter_model.safetensors").is_file()
