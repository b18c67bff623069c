"""Every family's weight table against its model, both ways: each parameter of the model has exactly one row,
each row is a parameter of some variant of the families that use the table, and HF -> jaxft -> HF is
byte-identical (tiny random transformers models, fp32)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import jaxft
from jaxft.io import param_shapes
from jaxft.models import FAMILIES, abstract_model

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=256)
# One variant per family, with the optional tensors switched on somewhere (biases, untied heads, q/k norm).
VARIANTS = {
    "llama": dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    "mistral": dict(sliding_window=16, tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=False),
    "qwen3": dict(tie_word_embeddings=True),
    "gemma2": dict(attention_bias=True, tie_word_embeddings=False, sliding_window=16),
    "gemma3_text": dict(sliding_window=16),
    "qwen3_moe": dict(attention_bias=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      mlp_only_layers=[0]),  # layer 0 dense: both layer stacks
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False),
}


VLMS = {"qwen2_vl", "qwen2_5_vl"}  # vision-language families: tests/test_qwen2_vl.py checks their tables


def test_every_family_has_a_variant():
    assert set(VARIANTS) == set(FAMILIES) - VLMS


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for model_type, overrides in VARIANTS.items():
        config = transformers.AutoConfig.for_model(model_type, **{**BASE, **overrides})
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.normal_(0.0, 0.2)
        path = tmp_path_factory.mktemp(model_type)
        model.save_pretrained(path)
        out[model_type] = path
    return out


def test_every_parameter_has_exactly_one_row_and_every_row_a_parameter(saved):
    used = collections.defaultdict(set)  # table id -> paths some model of it has
    for model_type, path in saved.items():
        family = FAMILIES[model_type]
        cfg = jaxft.from_pretrained(path, dtype="float32").config
        paths = set(param_shapes(abstract_model(cfg)))
        # One row per path, or one per part of it (Qwen3-MoE's gate and up halves; validate_table checks those).
        rows = collections.Counter(row.path for row in family.table if row.part is None or row.part[0] == 0)
        assert all(rows[p] == 1 for p in paths), [p for p in paths if rows[p] != 1]
        used[id(family.table)] |= paths
    for family in FAMILIES.values():
        if family.model_type in VLMS:
            continue
        unused = [row.hf for row in family.table if row.path not in used[id(family.table)]]
        assert not unused, f"{family.model_type}: rows no variant uses: {unused}"


@pytest.mark.parametrize("model_type", list(VARIANTS))
def test_round_trip_is_byte_identical(saved, tmp_path, model_type):
    src_dir = saved[model_type]
    out = jaxft.save_pretrained(jaxft.from_pretrained(src_dir, dtype="float32"), tmp_path / "out")
    src, dst = load_file(src_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(src) == sorted(dst)
    for name in src:
        assert src[name].shape == dst[name].shape and src[name].tobytes() == dst[name].tobytes(), name
    again = transformers.AutoConfig.from_pretrained(out)
    assert again.model_type == model_type
    np.testing.assert_equal(jaxft.from_pretrained(out, dtype="float32").config,
                            jaxft.from_pretrained(src_dir, dtype="float32").config)
