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


# One per loss type (TRL's names); robust with label smoothing.
DPO_CASES = {"sigmoid": dict(beta=0.1), "robust": dict(beta=0.5, loss_type="robust", label_smoothing=0.2),
             "hinge": dict(beta=0.5, loss_type="hinge"), "ipo": dict(beta=0.5, loss_type="ipo")}


@pytest.fixture(scope="module")
def ours(tiny):
    """The pairs' batch, the perturbed LoRA model (split), and every DPO_CASES loss type's loss, gradient and
    metric sums on it as one micro-batch: one program for the four (their policy and reference forward passes are
    the same computation)."""
    from jaxft.data.pipeline import DataConfig
    from jaxft.data.preference import build_preference_datasets
    from jaxft.io import from_pretrained
    from jaxft.lora import LoraConfig, apply_lora
    from jaxft.train import split_model, stack_micro_batches
    from jaxft.train.dpo import DpoConfig

    model_dir, data = tiny
    # Two rows of 128 tokens, two pairs each: a row's second pair is its segments 3 and 4.
    train_ds, _ = build_preference_datasets(DataConfig(path=str(data), max_seq_length=128, batch_size=2),
                                            str(model_dir))
    assert train_ds.num_pairs == len(PAIRS) and train_ds.num_batches_per_epoch == 1
    batch = train_ds.batch(0)
    assert (batch["segment_ids"].max(axis=1) == 4).all()

    model = from_pretrained(model_dir, "float32")
    apply_lora(model, LoraConfig(r=RANK, alpha=ALPHA, target_modules=TARGETS), seed=0)
    perturb_lora_b(model)  # B = 0 would make the policy the reference: loss ln 2, rewards 0
    graphdef, lora, frozen = split_model(model)
    objectives = {case: DpoConfig(**dpo) for case, dpo in DPO_CASES.items()}
    sums = jax.jit(lambda lo, fr, b: {case: objective.loss_and_grad_sums(graphdef, lo, fr, b, None)
                                      for case, objective in objectives.items()})
    return dict(batch=batch, graphdef=graphdef, lora=lora, frozen=frozen, lora_host=jax.tree.map(np.array, lora),
                objectives=objectives, sums=sums(lora, frozen, stack_micro_batches(batch, 1)))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DPO_CASES))
def test_loss_metrics_and_gradients_match_trl(tiny, ours, tmp_path, case):
    from jaxft.train import make_optimizer, make_train_step, stack_micro_batches
    from jaxft.train.dpo import METRICS

    model_dir, _ = tiny
    dpo, objective = DPO_CASES[case], ours["objectives"][case]
    loss_sum, grad_sum, count, metric_sums = ours["sums"][case]
    assert float(count) == len(PAIRS)

    t_loss, t_metrics, t_grads = _trl_step(model_dir, ours["lora_host"], tmp_path, **dpo)
    assert abs(t_loss - np.log(2)) > 1e-3 and abs(t_metrics["rewards/margins"]) > 1e-3  # the adapter bites
    np.testing.assert_allclose(float(loss_sum) / len(PAIRS), t_loss, rtol=1e-5, atol=1e-5)
    for key in METRICS:
        np.testing.assert_allclose(float(metric_sums[key]) / len(PAIRS), t_metrics[key], rtol=1e-5, atol=1e-5,
                                   err_msg=key)
    for (layer, name, m), want in t_grads.items():
        parent = OUR_PARENT[HF_PARENT[name]]
        got = np.asarray(grad_sum["layers"][parent][name][f"lora_{m.lower()}"][layer]) / len(PAIRS)
        assert rel_err(got, want) < 1e-4, (layer, name, m, rel_err(got, want))

    if objective.loss_type != "sigmoid":  # (the loss type changes none of what follows)
        return
    # The training step on two micro-batches of one row reports TRL's numbers under TRL's names: a pair never
    # straddles micro-batches, and the gradients summed over both are TRL's (their global norm).
    lora = ours["lora"]
    step = make_train_step(ours["graphdef"], make_optimizer(1e-3), objective=objective, donate=False)
    _, _, metrics = step(lora, make_optimizer(1e-3).init(lora), ours["frozen"], stack_micro_batches(ours["batch"], 2),
                         jax.random.key(0))
    np.testing.assert_allclose(float(metrics["loss"]), t_loss, rtol=1e-5, atol=1e-5)
    for key in METRICS:
        np.testing.assert_allclose(float(metrics[key]), t_metrics[key], rtol=1e-5, atol=1e-5, err_msg=key)
    assert float(metrics["num_pairs"]) == len(PAIRS)
    t_norm = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in t_grads.values()))
    np.testing.assert_allclose(float(metrics["grad_norm"]), t_norm, rtol=1e-4)


def test_conversational_pair_takes_the_sft_template_and_mask():
    """A conversational pair's sequences are the SFT chat records prompt + reply, token for token and mask for mask
    (the tiny Llama's template marks replies with {% generation %}: SFT reads that mask, the pair finds the reply
    after the prompt's generation prompt); an implicit prompt (the messages chosen and rejected share) is the
    same pair."""
    from jaxft.data.formatting import Formatter, load_tokenizer
    from jaxft.data.preference import preference_pair
    from jaxft.data.sources import Record

    tok = load_tokenizer(REPO / "examples/tiny-llama")
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    chosen, rejected = [{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "six"}]
    fmt = Formatter(tok)
    pair = preference_pair(fmt, Record({"prompt": prompt, "chosen": chosen, "rejected": rejected}, "p.jsonl:1"))
    implicit = preference_pair(fmt, Record({"chosen": prompt + chosen, "rejected": prompt + rejected}, "p.jsonl:2"))
    for doc, again, reply in zip(pair, implicit, (chosen, rejected)):
        sft = fmt(Record({"messages": prompt + reply}, "sft.jsonl:1"))
        np.testing.assert_array_equal(doc.tokens, sft.tokens)
        np.testing.assert_array_equal(doc.loss_mask, sft.loss_mask)
        np.testing.assert_array_equal(again.tokens, sft.tokens)
        np.testing.assert_array_equal(again.loss_mask, sft.loss_mask)
        assert tok.decode(doc.tokens[doc.loss_mask]) == reply[0]["content"] + "<|eot_id|>"


@pytest.mark.parametrize("record, line, words", [
    ({"prompt": "a", "chosen": "b"}, 2, ["no 'rejected'", "add 'rejected'"]),
    ({"chosen": "b", "rejected": "c"}, 2, ["no 'prompt'"]),
    ({"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": "c"}]}, 2,
     ["'rejected' as lists of messages"]),
    ({"prompt": "a", "chosen": 3, "rejected": "c"}, 2, ["key 'chosen' must be a string or a list of messages"]),
    ({"messages": [{"role": "user", "content": "hi"}]}, 2, ["no 'chosen'"]),
], ids=["no-rejected", "no-prompt", "mixed", "not-text", "sft-record"])
def test_bad_record_is_one_line_naming_file_line_and_key(tiny, tmp_path, record, line, words):
    from jaxft.data.errors import MissingFieldError
    from jaxft.data.pipeline import DataConfig
    from jaxft.data.preference import build_preference_datasets

    model_dir, _ = tiny
    data = _jsonl(tmp_path / "bad.jsonl", [PAIRS[0], record])
    with pytest.raises(MissingFieldError) as e:
        build_preference_datasets(DataConfig(path=str(data), max_seq_length=128, batch_size=1), str(model_dir))
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{data}:{line}: ")
    for word in words:
        assert word in message, message


def test_preference_data_without_trainer_dpo_says_so(tiny, tmp_path):
    from jaxft.data.errors import MissingFieldError
    from jaxft.data.pipeline import DataConfig, build_datasets

    model_dir, data = tiny
    with pytest.raises(MissingFieldError, match=rf"^4 records cannot be trained on: {data}:1: .*set `trainer: dpo`"):
        build_datasets(DataConfig(path=str(data), max_seq_length=128, batch_size=1), str(model_dir))


def test_dpo_keys_are_checked(tiny, tmp_path):
    from jaxft.train import TrainConfig, TrainConfigError

    model_dir, data = tiny
    base = dict(model_name_or_path=str(model_dir), dataset=str(data), output_dir=str(tmp_path / "out"))
    assert TrainConfig(**base).objective_config is None
    dpo = TrainConfig(**base, trainer="dpo", beta=0.5, loss_type="robust", label_smoothing=0.1).objective_config
    assert (dpo.beta, dpo.loss_type, dpo.label_smoothing) == (0.5, "robust", 0.1)
    listed = TrainConfig(**base, trainer="dpo", loss_type=["robust"]).objective_config
    assert listed.loss_type == "robust"  # TRL's list
    for values, words in ((dict(beta=0.2), "key 'beta' is a DPO setting and trainer is 'sft'"),
                          (dict(trainer="dpo", beta=0.0), "key 'beta'"),
                          (dict(trainer="dpo", label_smoothing=0.1), "loss_type: robust"),
                          (dict(trainer="dpo", loss_type=["sigmoid", "hinge"]), "jaxft trains one loss type"),
                          (dict(trainer="dpo", loss_type=["exo_pair"]), "'loss_type': value 'exo_pair' is not one of"),
                          (dict(trainer="dpo", loss_type="ipo", label_smoothing=0.1), "loss_type: robust"),
                          (dict(trainer="dpo", loss_type="robust", label_smoothing=0.5), "[0, 0.5)"),
                          (dict(trainer="dpo", completion_only_loss=False), "key 'completion_only_loss': false"),
                          (dict(trainer="dpo", modules_to_save=["lm_head"]), "key 'modules_to_save' with trainer dpo")):
        with pytest.raises(TrainConfigError) as e:
            TrainConfig(**base, **values)
        assert words in str(e.value), str(e.value)


def test_jaxft_train_dpo_example(tmp_path):
    """examples/dpo.yaml through jaxft-train's path, shortened: TRL's metrics logged, the eval loss a mean over the
    eval pairs, and the adapter an ordinary PEFT adapter (PEFT loads it onto the base)."""
    from transformers import AutoModelForCausalLM

    from jaxft.train import load_config, read_metrics, train
    from jaxft.train.dpo import METRICS

    config = load_config(REPO / "examples/dpo.yaml", [
        f"output_dir={tmp_path / 'run'}", "max_steps=2", "logging_steps=1", "per_device_train_batch_size=2",
        "per_device_eval_batch_size=8", "lora_target_modules=[q_proj,v_proj]", "save_strategy=no"])
    assert config.objective_config is not None
    result = train(config)
    rows = read_metrics(result.metrics_path)
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert set(METRICS) <= set(r) and r["num_pairs"] >= 2 and 0 <= r["rewards/accuracies"] <= 1
    assert abs(steps[0]["loss"] - np.log(2)) < 1e-5  # step 1: the adapter starts at B = 0, the reference itself
    assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert [r["eval_num_pairs"] for r in evals] == [80, 80] and abs(evals[0]["eval_loss"] - np.log(2)) < 1e-5
    assert evals[-1]["eval_loss"] != evals[0]["eval_loss"]
    assert all(0 <= r["eval_rewards/accuracies"] <= 1 and set(f"eval_{k}" for k in METRICS) <= set(r) for r in evals)
    assert evals[0]["eval_rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    adapter = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    assert adapter["peft_type"] == "LORA" and set(adapter["target_modules"]) == {"q_proj", "v_proj"}
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(REPO / "examples/tiny-llama"),
                                            str(result.adapter_dir))
    b = loaded.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight
    assert float(b.abs().max()) > 0  # trained: B left its zero init


def test_rows_hold_whole_pairs_cut_to_fit(caplog):
    """A pair longer than a row keeps the first L tokens of each sequence (the largest L that fits both); a pair
    whose completion lies wholly beyond L is skipped, named; rows are whole pairs, chosen then rejected."""
    from jaxft.data.formatting import Document
    from jaxft.data.preference import PreferenceDataset

    def doc(n: int, prompt: int, name: str) -> Document:
        return Document(np.arange(1, n + 1), np.arange(n) >= prompt, name)

    pairs = [(doc(8, 2, "d:1"), doc(4, 2, "d:1")),   # 12 > 10: the short side whole, the long one cut to 6
             (doc(3, 1, "d:2"), doc(3, 1, "d:2")),   # 6: whole
             (doc(9, 7, "d:3"), doc(9, 7, "d:3"))]   # both cut to 5: the completions (from token 7) are gone
    with caplog.at_level("WARNING", logger="jaxft.data"):
        ds = PreferenceDataset(pairs, max_seq_length=10, batch_size=2, shuffle=False)
    assert ds.num_pairs == 2 and ds.num_rows == 2
    assert "d:1" in caplog.text and "truncated" in caplog.text and "d:3" in caplog.text and "skipped" in caplog.text
    batch = ds.batch(0)
    lengths = [[int((row == j).sum()) for j in (1, 2)] for row in batch["segment_ids"]]
    assert sorted(lengths) == [[3, 3], [6, 4]]
    assert batch["segment_ids"].max() == 2  # one pair per row here: 6 + 4 + 3 + 3 > 10
