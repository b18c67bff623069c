"""bridge.peft (PEFT adapter files as plain dicts) against files PEFT writes and PEFT's own matching rules."""

from __future__ import annotations

import json
import re

import ml_dtypes
import numpy as np
import peft
import pytest
import torch
import transformers
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.other import get_pattern_key
from safetensors import safe_open

from bridge import peft as pio

BASE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)
PATTERNS = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                rank_pattern={"model.layers.1.self_attn.q_proj": 2, "down_proj": 6}, alpha_pattern={"v_proj": 3})


def _hf(seed=0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **BASE),
                                                         dtype=torch.float32)


def _peft_dir(path, dtype=torch.float32, **fields):
    fields.setdefault("task_type", "CAUSAL_LM")
    model = peft.get_peft_model(_hf(), peft.LoraConfig(**fields))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    model.to(dtype).save_pretrained(path)
    return model


def _tensors(path):
    with safe_open(str(path / pio.ADAPTER_WEIGHTS_NAME), framework="pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


def test_reads_peft_file_and_writes_it_back_identically(tmp_path):
    model = _peft_dir(tmp_path / "peft", **PATTERNS)
    cfg, weights = pio.load_adapter(tmp_path / "peft")
    # Weights: PEFT layout, values exactly PEFT's.
    modules = {n: m for n, m in model.base_model.model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert sorted(weights) == sorted(modules)
    for name, (a, b) in weights.items():
        assert np.array_equal(a, modules[name].lora_A["default"].weight.detach().numpy())
        assert np.array_equal(b, modules[name].lora_B["default"].weight.detach().numpy())
    assert weights["model.layers.1.self_attn.q_proj"][0].shape == (2, 32)
    assert weights["model.layers.0.mlp.down_proj"][0].shape == (6, 48)

    pio.save_adapter(tmp_path / "ours", cfg, weights)
    meta_ref, ref = _tensors(tmp_path / "peft")
    meta, ours = _tensors(tmp_path / "ours")
    assert meta == meta_ref == {"format": "pt"}
    assert sorted(ours) == sorted(ref)
    for key in ref:
        assert ours[key].dtype == ref[key].dtype and torch.equal(ours[key], ref[key]), key

    # Every config key we write has PEFT's value (lists compared as sets: PEFT stores a set).
    written = json.loads((tmp_path / "ours" / pio.ADAPTER_CONFIG_NAME).read_text())
    reference = json.loads((tmp_path / "peft" / pio.ADAPTER_CONFIG_NAME).read_text())
    for key, value in written.items():
        assert key in reference, key
        if isinstance(value, list):
            assert sorted(value) == sorted(reference[key]), key
        else:
            assert value == reference[key], key


def test_make_adapter_config_is_what_peft_writes(tmp_path):
    _peft_dir(tmp_path / "peft", r=4, lora_alpha=16, target_modules=r".*\.(q|k)_proj", use_rslora=True,
              lora_dropout=0.05, exclude_modules=["model.layers.0.self_attn.k_proj"])
    reference = json.loads((tmp_path / "peft" / pio.ADAPTER_CONFIG_NAME).read_text())
    ours = pio.make_adapter_config(r=4, lora_alpha=16, target_modules=r".*\.(q|k)_proj", use_rslora=True,
                                   lora_dropout=0.05, exclude_modules=["model.layers.0.self_attn.k_proj"])
    assert {k: v for k, v in reference.items() if k in ours} == ours
    # What we leave out, PEFT defaults to the same value.
    defaults = peft.LoraConfig().to_dict()
    for key in set(reference) - set(ours):
        assert reference[key] == defaults.get(key) or key == "peft_version", key


NAMES = [n for n, _ in _hf().named_modules() if n]


@pytest.mark.parametrize("targets", [
    ["q_proj", "v_proj"], ["self_attn.q_proj", "model.layers.1.mlp.up_proj"], ["layers.0.mlp.down_proj", "proj"],
    r".*\.layers\.1\..*_proj", r"model\.layers\.\d+\.self_attn\.(q|k)_proj", "q_proj", ["lm_head", "embed_tokens"],
])
def test_target_matching_is_pefts(targets):
    config = peft.LoraConfig(target_modules=targets)
    for name in NAMES:
        assert pio.target_matches(name, targets) == bool(check_target_module_exists(config, name)), name


@pytest.mark.parametrize("excludes", [["k_proj"], r".*\.0\..*", ["model.layers.1.mlp.up_proj"]])
def test_exclusion_is_pefts(excludes):
    config = peft.LoraConfig(target_modules=r".*", exclude_modules=excludes)
    for name in NAMES:
        peft_excluded = isinstance(check_target_module_exists(config, name),
                                   peft.tuners.tuners_utils._ExcludedModule)
        assert pio.is_excluded(name, excludes) == peft_excluded, name


def test_pattern_key_is_pefts():
    patterns = {"q_proj": 1, r"layers\.1\.self_attn\.q_proj": 2, "mlp.*": 3, "model.layers.0.mlp.up_proj": 4,
                "proj": 5}
    for name in NAMES:
        expected = get_pattern_key(patterns.keys(), name)  # PEFT returns the name itself when nothing matches
        assert pio.pattern_key(patterns, name) == (expected if expected in patterns else None), name


def test_reads_bfloat16_adapters(tmp_path):
    _peft_dir(tmp_path / "bf16", dtype=torch.bfloat16, r=2, lora_alpha=4, target_modules=["o_proj"])
    _, weights = pio.load_adapter(tmp_path / "bf16")
    _, ref = _tensors(tmp_path / "bf16")
    a, b = weights["model.layers.0.self_attn.o_proj"]
    assert a.dtype == ml_dtypes.bfloat16
    ref_a = ref["base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"].float().numpy()
    assert np.array_equal(a.astype(np.float32), ref_a)


@pytest.mark.parametrize("fields, match", [
    (dict(target_modules=["q_proj"], use_dora=True), "DoRA"),
    (dict(target_modules=["q_proj"], lora_bias=True), "lora_bias"),
    (dict(target_modules=["embed_tokens"]), "embedding"),
    (dict(target_modules=["q_proj"], layers_to_transform=[1]), "layers_to_transform"),
    (dict(target_modules=["q_proj"], bias="lora_only"), "bias"),
    (dict(target_modules=["q_proj"], init_lora_weights="pissa"), "modifies the base weights"),
])
def test_unsupported_peft_features_are_refused(tmp_path, fields, match):
    if "pissa" in str(fields.get("init_lora_weights")):
        pytest.importorskip("scipy")
    _peft_dir(tmp_path / "a", r=2, lora_alpha=4, **fields)
    with pytest.raises(pio.AdapterError, match=match):
        pio.load_adapter(tmp_path / "a")


def test_embedding_weights_are_refused_even_if_config_looks_plain(tmp_path):
    _peft_dir(tmp_path / "a", r=2, lora_alpha=4, target_modules=["embed_tokens", "q_proj"])
    cfg = json.loads((tmp_path / "a" / pio.ADAPTER_CONFIG_NAME).read_text())
    assert cfg["target_modules"]  # the config alone is plain LoRA; the weights give it away
    with pytest.raises(pio.AdapterError, match="embedding LoRA matrices"):
        pio.load_adapter(tmp_path / "a")


def test_other_peft_types_are_refused(tmp_path):
    model = peft.get_peft_model(_hf(), peft.IA3Config(target_modules=["k_proj", "down_proj"],
                                                      feedforward_modules=["down_proj"], task_type="CAUSAL_LM"))
    model.save_pretrained(tmp_path / "ia3")
    with pytest.raises(pio.AdapterError, match="peft_type='IA3'"):
        pio.load_adapter(tmp_path / "ia3")


def test_inconsistent_files_are_refused(tmp_path):
    _peft_dir(tmp_path / "a", **PATTERNS)
    cfg_file = tmp_path / "a" / pio.ADAPTER_CONFIG_NAME
    cfg = json.loads(cfg_file.read_text())
    cfg["rank_pattern"] = {}
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(pio.AdapterError, match=r"down_proj\.lora_A\.weight has shape \[6, 48\].*rank 4"):
        pio.load_adapter(tmp_path / "a")

    (tmp_path / "b").mkdir()
    torch.save({}, tmp_path / "b" / "adapter_model.bin")
    (tmp_path / "b" / pio.ADAPTER_CONFIG_NAME).write_text(json.dumps(pio.make_adapter_config(
        r=2, lora_alpha=4, target_modules=["q_proj"])))
    with pytest.raises(pio.AdapterError, match="adapter_model.bin: a pickle"):
        pio.load_adapter(tmp_path / "b")
    with pytest.raises(pio.AdapterError, match="no adapter_config.json"):
        pio.load_adapter(tmp_path)


def test_writes_are_atomic_and_checked(tmp_path):
    cfg = pio.make_adapter_config(r=2, lora_alpha=4, target_modules=["q_proj"])
    good = {"model.layers.0.self_attn.q_proj": (np.ones((2, 32), np.float32), np.zeros((32, 2), np.float32))}
    target = tmp_path / "adapter"
    pio.save_adapter(target, cfg, good)
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    # A bad rank is caught before anything is written.
    bad = {"model.layers.0.self_attn.q_proj": (np.ones((3, 32), np.float32), np.zeros((32, 3), np.float32))}
    with pytest.raises(pio.AdapterError, match="r=2"):
        pio.save_adapter(tmp_path / "other", cfg, bad)
    assert not (tmp_path / "other").exists()

    with pytest.raises(pio.AdapterError, match="overwrite=True"):
        pio.save_adapter(target, cfg, good)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before

    doubled = {k: (2 * a, b) for k, (a, b) in good.items()}
    pio.save_adapter(target, cfg, doubled, overwrite=True)
    _, back = pio.load_adapter(target)
    assert np.array_equal(back["model.layers.0.self_attn.q_proj"][0], 2 * good["model.layers.0.self_attn.q_proj"][0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"], "no temp dirs left behind"


@pytest.mark.parametrize("key, value, match", [
    ("r", 0, "positive integer"),
    ("lora_alpha", "8", "finite number"),
    ("target_modules", [], "non-empty list"),
    ("target_modules", "(", "not a valid regular expression"),
    ("rank_pattern", {"q_proj": 1.5}, r"rank_pattern\['q_proj'\]"),
    ("task_type", "SEQ_CLS", "CAUSAL_LM"),
])
def test_config_errors_name_the_key(key, value, match):
    cfg = dict(pio.make_adapter_config(r=2, lora_alpha=4, target_modules=["q_proj"]), **{key: value})
    with pytest.raises(pio.AdapterError, match=match) as err:
        pio.check_adapter_config(cfg, "somewhere/adapter_config.json")
    assert str(err.value).startswith("somewhere/adapter_config.json: ")
    assert re.search(re.escape(key), str(err.value))
