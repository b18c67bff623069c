"""`jaxft-train`: one-line errors with exit code 2 and no output_dir on bad input; a full small run's outputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxft.cli import main
from jaxft.train import TrainConfig, TrainConfigError, load_config, read_metrics
from test_train_fixtures import make_jsonl, make_tiny_model


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    make_tiny_model(d / "model")
    make_jsonl(d / "train.jsonl", 40, seed=0)
    make_jsonl(d / "eval.jsonl", 8, seed=1)
    return d


def _write_config(d: Path, name="run.yaml", **overrides) -> Path:
    cfg = dict(model_name_or_path=str(d / "model"), dataset=str(d / "train.jsonl"), output_dir=str(d / name[:-5]),
               max_seq_length=64, per_device_train_batch_size=2, max_steps=4, lora_r=4, disable_tqdm=True)
    cfg.update(overrides)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    path = d / name
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _fails(capsys, argv, *needles):
    """Runs the CLI expecting a bad-input exit: code 2, one error line naming `needles`, no traceback."""
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("jaxft-train: error:")]
    assert len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def test_unknown_key_suggests_the_close_one(workdir, capsys):
    path = _write_config(workdir, "unknown.yaml", learning_rat=1e-4)
    _fails(capsys, [path], str(path), "unknown key 'learning_rat'", "did you mean 'learning_rate'?")
    _fails(capsys, [_write_config(workdir, "unknown2.yaml"), "lora_rnk=8"], "unknown key 'lora_rnk'",
           "did you mean 'lora_r'?")
    assert not (workdir / "unknown").exists() and not (workdir / "unknown2").exists()


def test_wrong_type_names_key_value_and_expected_type(workdir, capsys):
    _fails(capsys, [_write_config(workdir, "wt.yaml", lora_r="sixteen")],
           "key 'lora_r'", "'sixteen'", "expected an integer")
    _fails(capsys, [_write_config(workdir, "wt2.yaml"), "max_steps=1.5"],
           "command line", "key 'max_steps'", "1.5", "expected an integer")
    _fails(capsys, [_write_config(workdir, "wt3.yaml", lr_scheduler_type="cosin")],
           "key 'lr_scheduler_type'", "did you mean 'cosine'?")
    _fails(capsys, [_write_config(workdir, "wt4.yaml", bf16="yes please")], "key 'bf16'", "expected true/false")
    assert not any((workdir / n).exists() for n in ("wt", "wt2", "wt3", "wt4"))


def test_missing_paths(workdir, capsys):
    _fails(capsys, [_write_config(workdir, "mp.yaml", dataset=str(workdir / "nope.jsonl"))],
           "key 'dataset'", "nope.jsonl", "does not exist")
    _fails(capsys, [_write_config(workdir, "mp2.yaml", model_name_or_path=str(workdir / "no_model"))],
           "key 'model_name_or_path'", "does not exist")
    _fails(capsys, [workdir / "no_config.yaml"], "no_config.yaml", "does not exist")
    _fails(capsys, [_write_config(workdir, "mp3.yaml"), "--resume"], "resume_from_checkpoint",
           "no complete checkpoint")
    assert not any((workdir / n).exists() for n in ("mp", "mp2", "mp3"))


def test_bad_target_module_lists_the_existing_ones(workdir, capsys):
    path = _write_config(workdir, "tm.yaml", lora_target_modules=["q_proj", "qq_proj"])
    _fails(capsys, [path], "lora_target_modules", "'qq_proj'", "q_proj, k_proj, v_proj, o_proj")
    assert not (workdir / "tm").exists()


def test_bad_data_line_is_named(workdir, capsys):
    bad = workdir / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n', encoding="utf-8")
    _fails(capsys, [_write_config(workdir, "bd.yaml", dataset=str(bad))],
           f"{bad}: 1 line is not a valid JSON object: line 2 col 10 (Expecting value)")
    assert not (workdir / "bd").exists()


def test_yaml_scalars_and_aliases(workdir):
    path = _write_config(workdir, "ok.yaml", max_length=48, max_seq_length=None)
    path.write_text(path.read_text() + "learning_rate: 1e-4\n", encoding="utf-8")
    cfg = load_config(path, ["lora_target_modules=[q_proj, v_proj]", "warmup_ratio=.1"])
    assert cfg.optim.learning_rate == 1e-4 and isinstance(cfg.optim.learning_rate, float)
    assert cfg.model.max_seq_length == 48
    assert load_config(path, ["max_seq_length=32"]).model.max_seq_length == 32  # an override beats the file's alias
    with pytest.raises(TrainConfigError, match="key 'max_seq_length' is given twice"):
        load_config(_write_config(workdir, "twice.yaml", max_length=48))
    assert cfg.lora.lora_target_modules == ("q_proj", "v_proj")
    assert cfg.optim.warmup_ratio == 0.1
    with pytest.raises(TrainConfigError, match="required key 'output_dir' is missing"):
        TrainConfig.from_dict({"model_name_or_path": str(workdir / "model"), "dataset": str(workdir / "train.jsonl")})


def test_full_run_writes_metrics_plot_adapter_and_merged_model(workdir, capsys):
    """A run from a config file, with the command line's flags and overrides over it (`--gradient_checkpointing`:
    the lean preset) and their record in train_config.json."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = _write_config(workdir, "full.yaml", eval_dataset=str(workdir / "eval.jsonl"), logging_steps=1,
                         save_steps=2, eval_steps=2, save_merged_model=True, bf16=False, learning_rate=5e-3,
                         lr_scheduler_type="cosine", warmup_steps=1, max_steps=6, lora_r=4)
    assert main([str(path), "--gradient_checkpointing", "--max-steps", "4", "lora_r=2"]) == 0
    captured = capsys.readouterr()
    out_text = captured.out
    assert "[jaxft] gradient_checkpointing=true -> memory: lean (layer inputs in host memory, the rest recomputed)" \
        in captured.err
    out = workdir / "full"
    for needle in (str(out / "adapter"), str(out / "merged"), str(out / "metrics.jsonl"), "PeftModel.from_pretrained"):
        assert needle in out_text

    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) and r["num_tokens"] > 0 and r["tokens_per_second"] > 0 for r in train)
    assert train[0]["learning_rate"] == 0.0  # warmup starts at 0, like transformers
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 2, 4]  # 0: the baseline before training
    assert [r["step"] for r in records if "checkpoint" in r] == [2, 4]
    assert (out / "loss_curve.png").stat().st_size > 1000
    saved = json.loads((out / "train_config.json").read_text())
    assert (saved["gradient_checkpointing"], saved["memory"], saved["max_steps"], saved["lora_r"]) == (
        True, "lean", 4, 2)

    # The exported adapter loads in PEFT and gives the logits of the exported merged model.
    ids = torch.tensor([[1, 10, 11, 12, 4, 20, 21, 5, 6, 7]])
    base = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, out / "adapter")
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert lora_b and any(float(p.abs().max()) > 0 for p in lora_b)  # trained (B starts at 0)
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32)
    with torch.no_grad():
        np.testing.assert_allclose(peft_model(ids).logits.numpy(), merged(ids).logits.numpy(), atol=1e-4)
    assert (out / "merged" / "tokenizer.json").exists() and (out / "adapter" / "tokenizer.json").exists()

    # Training again into the same output_dir without resume/overwrite is refused (and changes nothing).
    _fails(capsys, [path], "already holds checkpoints", "resume_from_checkpoint=true")


def test_resume_flag_takes_a_path_only_when_it_is_a_directory(tmp_path):
    from jaxft.cli import _parse

    args = _parse(["run.yaml", "--resume", "learning_rate=1e-4"])
    assert (args.config, args.overrides, args.resume) == ("run.yaml", ["learning_rate=1e-4"], "true")
    args = _parse(["--resume", "run.yaml", "max_steps=3"])
    assert (args.config, args.overrides, args.resume) == ("run.yaml", ["max_steps=3"], "true")
    args = _parse(["run.yaml", "--resume", str(tmp_path)])
    assert (args.config, args.overrides, args.resume) == ("run.yaml", [], str(tmp_path))
    assert _parse(["run.yaml"]).resume is None


def test_overrides_in_every_hf_spelling_mean_what_hfargumentparser_reads(workdir):
    """`--key value`, `--key=value`, `--key-with-dashes`, bare bools and `--no_KEY` read as transformers'
    HfArgumentParser reads them (over the bool/int/float keys of the keys table), mixed with `key=value` words."""
    import dataclasses

    from transformers import HfArgumentParser

    from jaxft.cli import _parse
    from jaxft.train.keys import KEYS

    mirror = dataclasses.make_dataclass("Mirror", [(k.name, k.type, k.default) for k in KEYS
                                                   if k.type in (bool, int, float)])
    hf_words = ["--learning-rate", "1e-4", "--max_steps=3", "--bf16", "false", "--overwrite_output_dir",
                "--no-assistant-only-loss", "--use_rslora", "--disable_tqdm", "yes", "--seed", "7",
                "--warmup-ratio=0.25", "--max_grad_norm", "0", "--no_completion_only_loss", "--lora_alpha", "8"]
    (expected,) = HfArgumentParser(mirror).parse_args_into_dataclasses(args=hf_words)
    args = _parse([str(_write_config(workdir, "spell.yaml")), *hf_words[:5], "lora_r=2", *hf_words[5:]])
    cfg = load_config(args.config, args.overrides)
    given = {"learning_rate", "max_steps", "bf16", "overwrite_output_dir", "assistant_only_loss", "use_rslora",
             "disable_tqdm", "seed", "warmup_ratio", "max_grad_norm", "completion_only_loss", "lora_alpha"}
    assert {k: cfg.to_dict()[k] for k in given} == {k: getattr(expected, k) for k in given}
    assert cfg.lora.lora_r == 2
    assert _parse(["run.yaml", "--max_steps", "-1", "--bf16", "--traceback"]).overrides == ["max_steps=-1", "bf16=true"]
    assert _parse(["run.yaml", "--bf16", "max_steps=2"]).overrides == ["bf16=true", "max_steps=2"]  # bare, then k=v


def test_no_config_gives_the_usage_line_and_one_error(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("usage: jaxft-train") and "CONFIG [overrides ...]" in " ".join(err[:-1])
    assert err[-1] == ("jaxft-train: error: give a YAML config file (CONFIG), e.g. jaxft-train examples/quickstart.yaml"
                       ", or the keys themselves: --model_name_or_path DIR --dataset_name FILE --output_dir DIR")
    assert main(["run.yaml", "--learning_rate"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("jaxft-train: error: --learning_rate needs a value: write "
                                                       "--learning_rate VALUE or --learning_rate=VALUE")
    assert main(["run.yaml", "stray"]) == 2
    assert "'stray' is a second config file or an override without a value" in capsys.readouterr().err


def test_help_and_version(capsys):
    import importlib.metadata

    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "CONFIG [overrides ...]" in out and "--key value, --key=value or key=value" in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"jaxft {importlib.metadata.version('jaxft')}\n"


def test_unknown_option_is_an_unknown_key(workdir, capsys):
    _fails(capsys, [_write_config(workdir, "uo.yaml"), "--lerning-rate", "1e-4", "--lora_rnk=4"],
           "command line: unknown keys: 'lerning_rate' (did you mean 'learning_rate'?), 'lora_rnk' (did you mean "
           "'lora_r'?)")
    assert not (workdir / "uo").exists()
