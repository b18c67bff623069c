"""Full fine-tuning (`finetuning_type: full`) against transformers: the gradient of every weight, AdamW steps with
transformers Trainer's weight-decay groups, and a `jaxft-train` run whose exported checkpoint transformers loads,
resumed bit-exactly."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

from bridge.hf import hf_tensors
from jaxft.config import ModelConfig
from jaxft.families import family_for
from jaxft.io import from_pretrained, model_params, save_pretrained
from jaxft.lora import LoraConfig
from jaxft.models import abstract_model
from jaxft.run import Run
from jaxft.train import (TrainConfig, TrainConfigError, loss_and_grad_sums, stack_micro_batches, token_loss_sum,
                         train)
from jaxft.train import full as full_ft
from jaxft.train.dpo import DpoConfig
from jaxft.train.optim import OptimConfig, make_optimizer
from jaxft.train.step import make_eval_step, make_train_step
from lora_helpers import hf_model_fp32, jax_logits, rel_err, torch_logits
from test_model_families import BASE, VARIANTS

REPO = Path(__file__).resolve().parents[1]
LR, WD, STEPS = 1e-2, 0.1, 2


def _tiny_llama(path: Path) -> transformers.PreTrainedModel:
    """A random fp32 Llama with biases on every linear and norms away from 1 (so biases and norms get gradients
    that differ from the kernels', and the decay groups matter), saved at `path`."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True,
                                   mlp_bias=True, tie_word_embeddings=False, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def _batch(seed: int, rows: int = 2, t: int = 16) -> dict[str, np.ndarray]:
    """One document per row: next-token targets, every position but the last trained."""
    ids = np.random.default_rng(seed).integers(0, 64, (rows, t + 1)).astype(np.int32)
    mask = np.ones((rows, t), np.int32)
    return dict(input_ids=ids[:, :-1], targets=ids[:, 1:], loss_mask=mask, segment_ids=mask.copy(),
                positions=np.broadcast_to(np.arange(t, dtype=np.int32), (rows, t)).copy())


def _hf_tensors(model) -> dict[str, np.ndarray]:
    """A model's weights under their transformers names, in torch's layouts."""
    cfg = model.config
    return dict(hf_tensors(family_for(cfg.model_type).table, model_params(model, merge_lora=False), cfg.num_layers))


def _hf_named(run: Run, state) -> dict[str, np.ndarray]:
    """A trainable state (weights or gradients) of `run` under its transformers names, in torch's layouts."""
    return _hf_tensors(nnx.merge(run.graphdef, state, run.frozen))


def test_gradients_and_adamw_steps_equal_transformers(tmp_path):
    hf = _tiny_llama(tmp_path / "model")
    optim = OptimConfig(learning_rate=LR, lr_scheduler_type="constant", weight_decay=WD, max_grad_norm=1.0)
    run = Run(tmp_path / "model", LoraConfig(), optim=optim, total_steps=STEPS, dtype="float32",
              finetuning_type="full").load()
    batches = [_batch(s) for s in range(STEPS)]

    # Gradients of the first batch's mean token loss, every weight.
    b0 = batches[0]
    loss_sum, grad_sum, count = jax.jit(lambda lo, b: loss_and_grad_sums(run.graphdef, lo, run.frozen, b, None,
                                                                         run.execution))(
        run.lora, stack_micro_batches(b0, 1))
    ours = _hf_named(run, jax.tree.map(lambda g: g / count, grad_sum))
    logits = hf(torch.tensor(b0["input_ids"], dtype=torch.long)).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), torch.tensor(b0["targets"]).reshape(-1).long())
    loss.backward()
    names = [n for n, _ in hf.named_parameters()]
    assert sorted(ours) == sorted(names), "jaxft trains exactly transformers' parameters"
    np.testing.assert_allclose(float(loss_sum / count), loss.item(), rtol=1e-6)
    for name, p in hf.named_parameters():
        assert float(np.abs(p.grad.numpy()).max()) > 0, name
        assert rel_err(ours[name], p.grad.numpy()) < 2e-5, name

    # AdamW steps, decay groups as transformers' Trainer builds them (no decay on biases and norms).
    decay = set(transformers.Trainer.get_decay_parameter_names(None, hf))
    assert any("bias" in n for n in names) and not any("bias" in n or "norm" in n for n in decay)
    groups = [{"params": [p for n, p in hf.named_parameters() if n in decay], "weight_decay": WD},
              {"params": [p for n, p in hf.named_parameters() if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=1e-8)
    before = {n: p.detach().clone().numpy() for n, p in hf.named_parameters()}
    for step, b in enumerate(batches):
        hf.zero_grad()
        logits = hf(torch.tensor(b["input_ids"], dtype=torch.long)).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, 64), torch.tensor(b["targets"]).reshape(-1).long()
                                          ).backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        run.step(b, step)
    ours = _hf_named(run, run.lora)
    for name, p in hf.named_parameters():
        want = p.detach().numpy()
        assert np.abs(want - before[name]).max() > LR, name  # every weight moved by about STEPS * lr
        # Adam turns fp32 noise in a near-zero gradient into up to 2e-5; a step of decay on a norm is 1e-3
        np.testing.assert_allclose(ours[name], want, rtol=0, atol=1e-4, err_msg=name)


def _chats(tmp: Path) -> Path:
    """The example's first 64 chats (two steps of two packed rows need far fewer than its 3000)."""
    path = tmp / "train.jsonl"
    if not path.is_file():
        lines = (REPO / "examples/data/train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
        path.write_text("".join(lines[:64]), encoding="utf-8")
    return path


def _config(tmp: Path, name: str, **over) -> dict:
    return {**dict(model_name_or_path=str(REPO / "examples/tiny-llama"),
                   dataset=str(_chats(tmp)), output_dir=str(tmp / name), finetuning_type="full",
                   max_seq_length=128, per_device_train_batch_size=2, max_steps=2, save_steps=1, logging_steps=1,
                   learning_rate=1e-3, lr_scheduler_type="constant", weight_decay=0.01, bf16=False, disable_tqdm=True,
                   report_to="none", seed=0), **over}


def test_jaxft_train_full_exports_an_hf_checkpoint_and_resumes_exactly(tmp_path):
    whole = train(TrainConfig.from_dict(_config(tmp_path, "whole")))
    assert whole.adapter_dir is None and not (tmp_path / "whole" / "adapter").exists()
    exported = whole.model_dir
    assert json.loads((exported / "config.json").read_text())["model_type"] == "llama"
    assert (exported / "tokenizer.json").is_file() and (exported / "generation_config.json").is_file()

    # transformers loads it; its logits equal jaxft's of the same weights, which differ from the base's.
    ids = np.random.default_rng(1).integers(4, 1000, (2, 24))
    theirs = torch_logits(hf_model_fp32(exported), ids)
    np.testing.assert_allclose(jax_logits(from_pretrained(exported, dtype="float32"), ids), theirs,
                               rtol=0, atol=2e-4 * np.abs(theirs).max())
    base = torch_logits(hf_model_fp32(REPO / "examples/tiny-llama"), ids)
    assert np.abs(theirs - base).max() > 1e-2

    # A new run resumed from the checkpoint of step 1: the same weights, bit for bit.
    resumed = train(TrainConfig.from_dict(_config(tmp_path, "resumed",
                                                  resume_from_checkpoint=str(tmp_path / "whole/checkpoints/1"))))
    assert resumed.resumed_from is not None and resumed.global_step == 2
    a, b = load_file(exported / "model.safetensors"), load_file(resumed.model_dir / "model.safetensors")
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("over, key", [
    (dict(load_in_4bit=True), "load_in_4bit"),
    (dict(lora_r=8), "lora_r"),
    (dict(lora_target_modules=["q_proj"]), "lora_target_modules"),
    (dict(save_merged_model=True), "save_merged_model"),
    (dict(execution={"layer_loop": "unroll"}), "layer_loop"),
    (dict(use_peft=False, finetuning_type="lora"), "use_peft"),
    (dict(trainer="dpo"), "trainer"),
])
def test_full_refuses_what_makes_no_sense(tmp_path, over, key):
    values = {**_config(tmp_path, "x"), **over}
    with pytest.raises(TrainConfigError) as e:
        TrainConfig.from_dict(values)
    assert e.value.key == key and "\n" not in str(e.value)


def test_dpo_needs_adapters_for_its_reference():
    """DPO's reference is the model with its adapters off: a full fine-tune (no adapters) is refused by the run and
    by the step, which would otherwise ignore the masters' cast."""
    with pytest.raises(ValueError, match="DPO reference"):
        Run(REPO / "examples/tiny-llama", LoraConfig(), finetuning_type="full", objective=DpoConfig())
    for make in (lambda: make_train_step(None, make_optimizer(1e-3), cast=lambda s: s, objective=DpoConfig()),
                 lambda: make_eval_step(None, cast=lambda s: s, objective=DpoConfig())):
        with pytest.raises(ValueError, match="takes no cast"):
            make()


def test_other_libraries_switches_mean_full(tmp_path):
    base = {k: v for k, v in _config(tmp_path, "x").items() if k != "finetuning_type"}
    assert TrainConfig.from_dict(base).lora.finetuning_type == "lora"
    assert TrainConfig.from_dict({**base, "use_peft": False}).lora.finetuning_type == "full"  # TRL
    assert TrainConfig.from_dict({**base, "full_finetuning": True}).lora.finetuning_type == "full"  # Unsloth
    assert TrainConfig.from_dict({**base, "use_peft": True}).lora.finetuning_type == "lora"
    # memory: max_context streams frozen weights; a full fine-tune has none and keeps its weights on the device.
    streamed = TrainConfig.from_dict({**base, "full_finetuning": True, "memory": "max_context"})
    assert streamed.execution_config.frozen_weights == "device"


def test_bf16_trains_fp32_masters_computes_and_exports_in_bf16(tmp_path):
    """A bf16 full fine-tune keeps fp32 master weights and AdamW moments; its step computes on the masters cast to
    bf16 (the first step's loss is the bf16 checkpoint's own), and its export is the masters rounded to bf16."""
    _tiny_llama(tmp_path / "model")
    run = Run(tmp_path / "model", LoraConfig(), optim=OptimConfig(learning_rate=1e-2), total_steps=1,
              dtype="bfloat16", finetuning_type="full").load()
    assert {x.dtype for x in jax.tree.leaves(run.lora)} == {np.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(run.opt_state) if x.ndim} == {np.dtype("float32")}
    batch = _batch(0)
    base = from_pretrained(tmp_path / "model", dtype="bfloat16")
    want = jax.jit(lambda m, b: token_loss_sum(m, b))(base, batch) / batch["loss_mask"].sum()
    assert float(run.step(batch, 0)["loss"]) == float(want)
    run.export_merged(tmp_path / "out")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    masters = _hf_named(run, run.lora)
    assert {v.dtype.name for v in saved.values()} == {"bfloat16"}
    for name, value in saved.items():
        np.testing.assert_array_equal(value.astype(np.float32), masters[name].astype(value.dtype).astype(np.float32),
                                      err_msg=name)


@pytest.mark.parametrize("model_type", list(VARIANTS))
def test_decay_groups_are_transformers_trainers_in_every_family(model_type, tmp_path):
    """The weights AdamW decays (`jaxft.train.full.decay_mask`, by norm type and bias name) are exactly those
    transformers' Trainer decays, in a variant of every text family with its optional tensors (biases, q/k norms,
    experts, sinks): the mask, as 1.0 / 0.0 weights, is exported and loaded by transformers, which names them."""
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **VARIANTS[model_type]})
    model = abstract_model(ModelConfig.from_hf(config.to_dict()), dtype=np.float32)
    graphdef, params, rest = nnx.split(model, full_ft.TRAINED_TYPE, ...)
    flags = jax.tree.map(lambda x, d: np.full(x.shape, float(d), np.float32), params,
                         full_ft.decay_mask(model)(params))
    save_pretrained(nnx.merge(graphdef, flags, rest), tmp_path / "flags")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "flags", dtype=torch.float32)
    values = {n: np.unique(p.detach().numpy()) for n, p in hf.named_parameters()}
    assert all(v.size == 1 for v in values.values())  # one group per parameter
    decayed = {n for n, v in values.items() if v[0] == 1.0}
    # (a tied head is the embedding's parameter: named_parameters lists it once, the Trainer's names twice)
    assert decayed == set(transformers.Trainer.get_decay_parameter_names(None, hf)) & set(values)
    assert decayed and set(values) - decayed  # both groups hold weights
