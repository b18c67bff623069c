"""`TrainConfig` from YAML and overrides: every unknown key in one error with its YAML line, key errors placed
at their line or on the command line, `gradient_checkpointing` (HF/TRL's switch) mapped to the lean preset, and the
`memory` presets with the `execution` mapping over them."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from jaxft.train import TrainConfig, TrainConfigError, load_config
from jaxft.train.keys import COMMAND_LINE, KEYS, Where
from test_train_fixtures import make_jsonl, make_tiny_model


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("train_config")
    return dict(model_name_or_path=str(make_tiny_model(d / "model")), dataset=str(make_jsonl(d / "train.jsonl", 4)),
                output_dir=str(d / "out"))


def _yaml(tmp_path: Path, paths: dict, extra_lines: str) -> Path:
    """A config file: the three required keys on lines 1-3, then `extra_lines` verbatim from line 4."""
    text = "".join(f"{k}: {v}\n" for k, v in paths.items()) + extra_lines
    path = tmp_path / "run.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def _error(path: Path, overrides=()) -> str:
    with pytest.raises(TrainConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_every_unknown_key_is_reported_once_with_its_line(tmp_path, paths):
    path = _yaml(tmp_path, paths, "learnin_rate: 1e-4\nlora_r: 8\nlora_rnk: 4\nzzzzzz: 1\n")
    message = _error(path, ["max_stepps=3"])
    assert message == (
        f"{path}: unknown keys: 'learnin_rate' (line 4; did you mean 'learning_rate'?), "
        "'lora_rnk' (line 6; did you mean 'lora_r'?), 'zzzzzz' (line 7), "
        "'max_stepps' (command line; did you mean 'max_steps'?); known keys: " +
        ", ".join(k.name for k in KEYS))


def test_unknown_keys_only_on_the_command_line_say_so(tmp_path, paths):
    path = _yaml(tmp_path, paths, "lora_r: 8\n")
    assert _error(path, ["lora_rnk=8", "learning_rat=1"]) == (
        "command line: unknown keys: 'lora_rnk' (did you mean 'lora_r'?), 'learning_rat' (did you mean "
        "'learning_rate'?)")
    assert _error(path, ["lora_rnk=8"]) == "command line: unknown key 'lora_rnk' (did you mean 'lora_r'?)"


def test_key_errors_name_the_yaml_line_or_the_command_line(tmp_path, paths):
    path = _yaml(tmp_path, paths, "# a comment\n\nlora_r: sixteen\nmax_steps: 5\n")
    assert _error(path).startswith(f"{path}:6: key 'lora_r': value 'sixteen' (str) has the wrong type")
    assert _error(path, ["lora_r=8", "max_steps=0"]).startswith("command line: key 'max_steps': value 0 is invalid")
    assert _error(path, ["lora_r=8", "max_steps=1.5"]).startswith("command line: key 'max_steps': value 1.5")
    path = _yaml(tmp_path, paths, "lr_scheduler_type: cosin\n")
    assert _error(path).startswith(f"{path}:4: key 'lr_scheduler_type': value 'cosin' is not one of")
    # An error about no single key keeps the file as its place.
    (tmp_path / "short.yaml").write_text(f"dataset: {paths['dataset']}\n", encoding="utf-8")
    assert _error(tmp_path / "short.yaml").startswith(f"{tmp_path / 'short.yaml'}: required key")


def test_path_errors_name_the_yaml_line_or_the_command_line(tmp_path, paths):
    path = _yaml(tmp_path, paths, "eval_dataset: /nowhere/eval.jsonl\n")
    assert _error(path).startswith(f"{path}:4: key 'eval_dataset': path '/nowhere/eval.jsonl' does not exist")
    assert _error(path, ["eval_dataset=null", "dataset=/nope.jsonl"]).startswith(
        "command line: key 'dataset': path '/nope.jsonl' does not exist")
    assert _error(path, ["eval_dataset=null", f"model_name_or_path={tmp_path}"]).startswith(
        f"command line: key 'model_name_or_path': '{tmp_path}' has no config.json")


def test_a_key_written_twice_in_the_file_is_an_error(tmp_path, paths):
    path = _yaml(tmp_path, paths, "lora_r: 8\nseed: 1\nlora_r: 4\n")
    assert _error(path) == f"{path}:6: key 'lora_r' is given twice (also on line 4); keep one"
    path = _yaml(tmp_path, paths, "max_length: 32\nmax_seq_length: 48\n")
    assert _error(path) == f"{path}:5: key 'max_seq_length' is given twice (directly and as alias 'max_length'); keep one"


def test_an_override_that_is_not_yaml_is_one_line(tmp_path, paths):
    path = _yaml(tmp_path, paths, "")
    message = _error(path, ["lora_target_modules=[q_proj, v_proj"])
    assert message.startswith("command line: override 'lora_target_modules=[q_proj, v_proj': the value is not valid "
                              "YAML")


def test_from_dict_places_errors_by_key(paths):
    where = {"lora_r": Where("a.yaml", 9), "seed": Where(COMMAND_LINE)}
    with pytest.raises(TrainConfigError, match=r"^a\.yaml:9: key 'lora_r'") as info:
        TrainConfig.from_dict({**paths, "lora_r": 0}, source="a.yaml", where=where)
    assert info.value.key == "lora_r"
    with pytest.raises(TrainConfigError, match=r"^command line: key 'seed'"):
        TrainConfig.from_dict({**paths, "seed": "x"}, source="a.yaml", where=where)
    with pytest.raises(TrainConfigError, match=r"^config: key 'seed'"):  # no `where`: the source, as before
        TrainConfig.from_dict({**paths, "seed": "x"})


def test_gradient_checkpointing_selects_lean_and_says_so(tmp_path, paths, caplog):
    with caplog.at_level(logging.INFO, logger="jaxft"):
        cfg = load_config(_yaml(tmp_path, paths, "gradient_checkpointing: true\n"))
    assert (cfg.memory.gradient_checkpointing, cfg.memory.memory, cfg.execution_config.remat) == (True, "lean",
                                                                                                   "offload")
    assert cfg.execution_config == TrainConfig(**paths, memory="lean").execution_config
    notes = [r.getMessage() for r in caplog.records if "gradient_checkpointing" in r.getMessage()]
    assert notes == ["gradient_checkpointing=true -> memory: lean (layer inputs in host memory, the rest "
                     "recomputed); set memory to choose another mode"]
    # The mode round-trips through to_dict (what train_config.json holds), with no second note.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxft"):
        assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert not caplog.records
    assert cfg.to_dict()["gradient_checkpointing"] is True and cfg.to_dict()["memory"] == "lean"


def test_gradient_checkpointing_with_or_without_remat(tmp_path, paths):
    def remat(**keys):
        return TrainConfig(**paths, **keys).execution_config.remat

    assert remat() == "auto"  # the default: chosen per run from the compiled step's memory
    assert remat(gradient_checkpointing=False) == "auto"
    assert remat(gradient_checkpointing=False, remat="full") == "full"
    assert remat(gradient_checkpointing=True, remat="full") == "full"  # a given policy wins
    loaded = load_config(_yaml(tmp_path, paths, "remat: full\n"), ["gradient_checkpointing=true"])
    assert loaded.execution_config.remat == "full"
    path = _yaml(tmp_path, paths, "gradient_checkpointing: true\nremat: none\n")
    assert _error(path) == (f"{path}:4: key 'gradient_checkpointing': true contradicts execution's remat: none; "
                            "drop one of the two, or choose memory: lean")
    path = _yaml(tmp_path, paths, "gradient_checkpointing: true\nmemory: fast\n")
    assert _error(path) == (f"{path}:4: key 'gradient_checkpointing': true contradicts memory: fast (no remat); "
                            "drop one of the two, or choose memory: lean")
    assert _error(_yaml(tmp_path, paths, "gradient_checkpointing: yes please\n")).startswith(
        f"{tmp_path / 'run.yaml'}:4: key 'gradient_checkpointing'")


def test_memory_presets_are_the_measured_recipes_and_execution_wins_per_field(tmp_path, paths, caplog):
    from jaxft.memory.execution import MEMORY_PRESETS, ExecutionConfig

    default = TrainConfig(**paths)
    assert default.memory.memory == "auto" and default.execution_config == ExecutionConfig(remat="auto")
    for name, fields in MEMORY_PRESETS.items():
        assert TrainConfig(**paths, memory=name).execution_config == ExecutionConfig(**fields)
    lean = TrainConfig(**paths, memory="lean").execution_config
    assert (lean.remat, lean.resolved_layer_loop, lean.ce_chunk_size) == ("offload", "scan", 256)
    assert TrainConfig(**paths, memory="max_context").execution_config.frozen_weights == "host"
    with caplog.at_level(logging.INFO, logger="jaxft"):
        cfg = load_config(_yaml(tmp_path, paths, "memory: lean\nexecution: {remat: full, mlp_chunk_size: 64}\n"))
    assert cfg.execution_config == lean.replace(remat="full", mlp_chunk_size=64)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory:")] == [
        "memory: lean; execution wins for remat: 'full' (preset 'offload')"]
    assert cfg.replace(max_steps=3).execution_config == cfg.execution_config  # the keys as given, not merged
    assert cfg.replace(memory="fast").execution_config == ExecutionConfig(remat="full", layer_loop="auto",
                                                                          mlp_chunk_size=64)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxft"):
        assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]


def test_flat_memory_keys_still_work_with_one_deprecation_line(tmp_path, paths, caplog):
    path = _yaml(tmp_path, paths, "remat: offload+attn\nlayer_loop: scan\n")
    with caplog.at_level(logging.INFO, logger="jaxft"):
        cfg = load_config(path)
    assert cfg.execution_config == TrainConfig(**paths, memory="balanced").execution_config
    assert [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()] == [
        f"{path}:4: deprecated flat keys remat, layer_loop: choose a mode with memory: (auto, fast, balanced, lean, "
        "max_context), or set the mechanism under execution: {remat: ...} (docs/memory.md)"]


def test_execution_mapping_errors_name_the_key_and_the_field(tmp_path, paths):
    path = _yaml(tmp_path, paths, "execution: {remat_plan: 'full:8'}\n")
    assert _error(path).startswith(f"{path}:4: key 'execution': unknown field 'remat_plan'; did you mean "
                                   "'remat_block'? fields: remat, remat_block,")
    path = _yaml(tmp_path, paths, "execution: {layer_loop: scn}\n")
    assert _error(path) == (f"{path}:4: key 'execution': layer_loop: value 'scn' is not one of 'auto', 'scan', "
                            "'unroll'")
    path = _yaml(tmp_path, paths, "layer_loop: scan\nexecution: {layer_loop: unroll}\n")
    assert _error(path) == (f"{path}:4: key 'layer_loop' is given twice, flat ('scan') and under execution "
                            "('unroll'); keep the one under execution")
    assert _error(_yaml(tmp_path, paths, "memory: tiny\n")).startswith(f"{path}:4: key 'memory': value 'tiny'")
    for gone in ("remat_layers: 2\n", "remat_plan: 'full:8'\n"):  # not user keys: no measured row pays for them
        assert "unknown key" in _error(_yaml(tmp_path, paths, gone))


def test_every_key_is_a_field_of_its_section_under_its_own_name(paths):
    from jaxft.train.keys import SECTIONS

    cfg = TrainConfig(**paths)
    assert [f.name for f in dataclasses.fields(cfg) if f.compare] == list(SECTIONS)  # the rest are built from them
    for name in SECTIONS:
        assert [f.name for f in dataclasses.fields(getattr(cfg, name))] == [k.name for k in KEYS if k.section == name]
    assert cfg.to_dict() == {k.name: (None if k.required else k.default) for k in KEYS} | paths | {"memory": "auto"}


def test_sections_and_the_parts_built_from_them(paths):
    from jaxft.train.sections import LoggingSection, ModelSection

    cfg = TrainConfig(**paths, bf16=False, logging_steps=5, eval_generate_prompts=["hi"], lora_r=4, lora_alpha=8,
                      bnb_4bit_quant_type="fp4", load_in_4bit=True, warmup_ratio=0.5)
    assert cfg.model == ModelSection(model_name_or_path=paths["model_name_or_path"], bf16=False)
    assert cfg.model.dtype == "float32" and TrainConfig(**paths).model.dtype == "bfloat16"
    assert cfg.logging == LoggingSection(output_dir=paths["output_dir"], logging_steps=5, eval_generate_prompts=("hi",))
    assert cfg.logging.eval_every == 5 and cfg.replace(eval_steps=3).logging.eval_every == 3
    # A key's row names the field it sets in its section's part (lora_r -> LoraConfig.r).
    assert (cfg.lora_config.r, cfg.lora_config.alpha, cfg.quant_config.quant_type) == (4, 8.0, "fp4")
    assert cfg.optim_config.warmup_ratio == 0.5 and TrainConfig(**paths).quant_config is None
    with pytest.raises(TrainConfigError, match="^key 'lora_dropout': ") as info:
        TrainConfig(**paths, lora_target_parameters=["experts.down_proj"], lora_dropout=0.1)
    assert info.value.key == "lora_dropout"


@pytest.mark.parametrize("section,values,message", [
    ("model", dict(model_name_or_path="/nowhere/model"),
     "key 'model_name_or_path': path '/nowhere/model' does not exist; fix the path"),
    ("model", dict(model_name_or_path=""), "key 'model_name_or_path': value '' is invalid; give a non-empty path"),
    ("model", dict(max_seq_length=1), "key 'max_seq_length': value 1 is invalid; must be an integer >= 2"),
    ("logging", dict(output_dir=" "), "key 'output_dir': value ' ' is invalid; give a non-empty path"),
    ("logging", dict(logging_steps=0), "key 'logging_steps': value 0 is invalid; must be an integer >= 1"),
    ("logging", dict(save_steps=True), "key 'save_steps': value True (bool) has the wrong type; expected an integer"),
    ("logging", dict(eval_steps=0), "key 'eval_steps': value 0 is invalid; must be an integer >= 1 (or null)"),
    ("logging", dict(save_total_limit=-1), "key 'save_total_limit': value -1 is invalid; must be an integer >= 1"),
    ("logging", dict(report_to="wandb"), "key 'report_to': value 'wandb' is not one of 'tensorboard', 'none'"),
    ("logging", dict(disable_tqdm="yes"), "key 'disable_tqdm': value 'yes' (str) has the wrong type; expected "
                                          "true/false"),
    ("logging", dict(eval_generate_prompts=["ok", " "]),
     "key 'eval_generate_prompts': value ['ok', ' '] is invalid"),
    ("logging", dict(eval_generate_max_new_tokens=0), "key 'eval_generate_max_new_tokens': value 0 is invalid"),
])
def test_a_section_rejects_bad_values_in_one_line(paths, section, values, message):
    from jaxft.train.sections import SECTION_CLASSES

    base = {"model": dict(model_name_or_path=paths["model_name_or_path"]),
            "logging": dict(output_dir=paths["output_dir"])}[section]
    with pytest.raises(TrainConfigError) as info:
        SECTION_CLASSES[section](**{**base, **values})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    assert info.value.key == next(iter(values))


def test_part_errors_name_the_flat_key_and_its_yaml_line(tmp_path, paths):
    # The model part's error under model_name_or_path, at its line; a logging key at its line, or on the command line.
    path = _yaml(tmp_path, {**paths, "model_name_or_path": "/nowhere/model"}, "")
    assert _error(path) == f"{path}:1: key 'model_name_or_path': path '/nowhere/model' does not exist; fix the path"
    path = _yaml(tmp_path, paths, "save_total_limit: 0\n")
    assert _error(path) == f"{path}:4: key 'save_total_limit': value 0 is invalid; must be an integer >= 1 (or null)"
    assert _error(path, ["save_total_limit=2", "eval_generate_prompts=[]"]).startswith(
        "command line: key 'eval_generate_prompts': value [] is invalid; give a non-empty list")
