"""DPO (`trainer: dpo`): the loss, metrics and LoRA gradients equal TRL's `DPOTrainer` (PEFT, torch, fp32) on the
same batch; preference records take SFT's chat template and masks; bad records and keys are one line; a
`jaxft-train` run of examples/dpo.yaml trains and exports an ordinary PEFT adapter."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from lora_helpers import perturb_lora_b, rel_err
from test_train_fixtures import REPO, make_tiny_model

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")

RANK, ALPHA = 4, 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HF_PARENT = {name: "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
             for name in TARGETS}
OUR_PARENT = {"self_attn": "attn", "mlp": "mlp"}
# Standard-format pairs (the char tokenizer of test_train_fixtures: one token per character): prompts and replies
# of different lengths, so padding, packing and the per-sequence sums all bite.
PAIRS = [
    {"prompt": "reverse: cat dog. ", "chosen": "dog cat", "rejected": "cat dog"},
    {"prompt": "reverse: sun moon red. ", "chosen": "red moon sun", "rejected": "sun red"},
    {"prompt": "reverse: tree fish. ", "chosen": "fish tree", "rejected": "tree fish bird star"},
    {"prompt": "count: a b c. ", "chosen": "3", "rejected": "two"},
]


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    return make_tiny_model(root / "model"), _jsonl(root / "pairs.jsonl", PAIRS)


def _copy_lora(pm, lora) -> None:
    """Our (perturbed) A and B into a PEFT model's LoRA."""
    with torch.no_grad():
        for layer, name, mod in _peft_linears(pm):
            ours = lora["layers"][OUR_PARENT[HF_PARENT[name]]][name]
            mod.lora_A["default"].weight.copy_(torch.from_numpy(np.asarray(ours["lora_a"][layer]).T.copy()))
            mod.lora_B["default"].weight.copy_(torch.from_numpy(np.asarray(ours["lora_b"][layer]).T.copy()))


def _peft_linears(pm):
    for layer in range(pm.config.num_hidden_layers):
        for name in TARGETS:
            yield layer, name, getattr(getattr(pm.base_model.model.model.layers[layer], HF_PARENT[name]), name)


def _trl_step(model_dir, lora, tmp_path, **dpo):
    """TRL's loss, metrics and LoRA gradients on all of PAIRS as one batch."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(PAIRS), report_to=[],
                         bf16=False, use_cpu=True, gradient_checkpointing=False, max_length=None, **dpo)
    # A new adapter (peft_config), so that the reference is the model with its adapters off, as ours; a PeftModel
    # passed in would have its adapter copied as the reference.
    trainer = trl.DPOTrainer(model=hf, args=args, train_dataset=Dataset.from_list(PAIRS),
                             processing_class=AutoTokenizer.from_pretrained(model_dir),
                             peft_config=peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                         target_modules=list(TARGETS)))
    pm = trainer.model
    _copy_lora(pm, lora)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(PAIRS))])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    grads = {(layer, name, m): getattr(mod, f"lora_{m}")["default"].weight.grad.numpy().T
             for layer, name, mod in _peft_linears(pm) for m in ("A", "B")}
    return float(loss.detach()), metrics, grads


@pytest.mark.parametrize("dpo", [dict(beta=0.1), dict(beta=0.5, loss_type="robust", label_smoothing=0.2)],
                         ids=["sigmoid", "robust"])
def test_loss_metrics_and_gradients_match_trl(tiny, tmp_path, dpo):
    from jaxft.data.pipeline import DataConfig
    from jaxft.data.preference import build_preference_datasets
    from jaxft.io import from_pretrained
    from jaxft.lora import LoraConfig, apply_lora
    from jaxft.train import make_optimizer, make_train_step, split_model, stack_micro_batches
    from jaxft.train.dpo import METRICS, DpoConfig

    model_dir, data = tiny
    # Two rows of 128 tokens, two pairs each: a row's second pair is its segments 3 and 4.
    train_ds, _ = build_preference_datasets(DataConfig(path=str(data), seq_len=128, batch_size=2), str(model_dir))
    assert train_ds.num_pairs == len(PAIRS) and train_ds.num_batches_per_epoch == 1
    batch = train_ds.batch(0)
    assert (batch["segment_ids"].max(axis=1) == 4).all()

    ours = from_pretrained(model_dir, "float32")
    apply_lora(ours, LoraConfig(r=RANK, alpha=ALPHA, target_modules=TARGETS), seed=0)
    perturb_lora_b(ours)  # B = 0 would make the policy the reference: loss ln 2, rewards 0
    graphdef, lora, frozen = split_model(ours)
    lora_host = jax.tree.map(np.array, lora)
    objective = DpoConfig(**dpo)

    sums = jax.jit(lambda lo, fr, b: objective.loss_and_grad_sums(graphdef, lo, fr, b, None))
    loss_sum, grad_sum, count, metric_sums = sums(lora, frozen, stack_micro_batches(batch, 1))
    assert float(count) == len(PAIRS)
    grad_sums = [grad_sum]
    if objective.loss_type == "sigmoid":  # (the loss type changes none of this: one compile less for robust)
        # Two micro-batches of one row: the same sums (a pair never straddles micro-batches).
        loss2, grad2, count2, _ = sums(lora, frozen, stack_micro_batches(batch, 2))
        np.testing.assert_allclose(float(loss2), float(loss_sum), rtol=1e-6)
        assert float(count2) == len(PAIRS)
        grad_sums.append(grad2)

    t_loss, t_metrics, t_grads = _trl_step(model_dir, lora_host, tmp_path, **dpo)
    assert abs(t_loss - np.log(2)) > 1e-3 and abs(t_metrics["rewards/margins"]) > 1e-3  # the adapter bites
    np.testing.assert_allclose(float(loss_sum) / len(PAIRS), t_loss, rtol=1e-5, atol=1e-5)
    for key in METRICS:
        np.testing.assert_allclose(float(metric_sums[key]) / len(PAIRS), t_metrics[key], rtol=1e-5, atol=1e-5,
                                   err_msg=key)
    for (layer, name, m), want in t_grads.items():
        parent = OUR_PARENT[HF_PARENT[name]]
        for g_sum in grad_sums:
            got = np.asarray(g_sum["layers"][parent][name][f"lora_{m.lower()}"][layer]) / len(PAIRS)
            assert rel_err(got, want) < 1e-4, (layer, name, m, rel_err(got, want))

    if objective.loss_type != "sigmoid":
        return
    # The training step reports the same numbers under TRL's names.
    step = make_train_step(graphdef, make_optimizer(1e-3), objective=objective)
    _, _, metrics = step(lora, make_optimizer(1e-3).init(lora), frozen, stack_micro_batches(batch, 1),
                         jax.random.key(0))
    np.testing.assert_allclose(float(metrics["loss"]), t_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(metrics["rewards/accuracies"]), t_metrics["rewards/accuracies"], atol=1e-6)
    assert float(metrics["num_pairs"]) == len(PAIRS)
