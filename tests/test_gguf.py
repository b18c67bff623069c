"""GGUF out and in (`jaxft.save_gguf`, GGUF files as base models), against transformers' GGUF loader.

Tiny random models of every dense family transformers reads from GGUF, LoRA attached with B perturbed and merged
on export: the f32 file's logits in transformers equal the merged jaxft model's; f16 / bf16 / q8_0 / q4_0 are
within their rounding; jaxft loading the same file equals transformers loading it. Sizes pick what transformers'
GGUF loader cannot read from the metadata at its config class defaults (Qwen3's head_dim 128, Gemma's
query_pre_attn_scalar 256).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import jaxft
from bridge import CheckpointError
from bridge import gguf as bgguf
from bridge.mappings import gguf as gnames
from jaxft.lora import LoraConfig
from lora_helpers import jax_logits, perturb_lora_b, rel_err, torch_logits

gguf = pytest.importorskip("gguf")

TOKENIZER = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama"
SEQ = 64
BASE = dict(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=3, pad_token_id=0)
FAMILIES = {
    "llama": dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
    "mistral": dict(sliding_window=None, tie_word_embeddings=True),  # transformers reads it back as Llama
    "qwen2": dict(tie_word_embeddings=False),
    "qwen3": dict(head_dim=128, tie_word_embeddings=False),
    "gemma2": dict(query_pre_attn_scalar=256, sliding_window=24, hidden_activation="gelu_pytorch_tanh"),
    "gemma3_text": dict(query_pre_attn_scalar=256, sliding_window=24, hidden_activation="gelu_pytorch_tanh"),
}


def _hf_dir(tmp: Path, model_type: str) -> Path:
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **FAMILIES[model_type]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms at 1 and biases at 0 would hide a mis-mapped or mis-offset tensor
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(0.0 if name.endswith("bias") or model_type.startswith("gemma") else 1.0, 0.2)
    model.save_pretrained(tmp / model_type)
    return tmp / model_type


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(4, 1024, (1, SEQ))


def _merged_model(path: Path):
    model = jaxft.from_pretrained(path, dtype="float32", verbose=False)
    model = jaxft.apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    perturb_lora_b(model, std=0.05)
    return model


def _hf_gguf(file: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                             dtype=torch.float32).eval()


# Llama (untied head) is the quantised exports' family below, against the merged model and read back at every
# dtype; its llama.cpp architecture at f32 here as the (tied) Mistral.
@pytest.mark.parametrize("model_type", [t for t in FAMILIES if t != "llama"])
def test_f32_export_matches_merged_model_in_transformers_and_loads_back(tmp_path, model_type, tokenizer, ids):
    model = _merged_model(_hf_dir(tmp_path, model_type))
    ours = jax_logits(model, ids)
    file = jaxft.save_gguf(model, tmp_path / "out" / "model.gguf", "f32", tokenizer=tokenizer)
    hf = _hf_gguf(file)
    read_as = "llama" if model_type == "mistral" else model_type  # no window: a Mistral is a Llama
    assert hf.config.model_type == read_as
    assert rel_err(torch_logits(hf, ids), ours) < 1e-5
    back = jaxft.from_pretrained(file, dtype="float32", verbose=False)
    assert back.config.model_type == read_as
    assert rel_err(jax_logits(back, ids), ours) < 1e-5


def test_quantised_exports_within_their_rounding_and_jaxft_reads_what_transformers_reads(tmp_path, tokenizer, ids):
    model = _merged_model(_hf_dir(tmp_path, "llama"))
    ours = jax_logits(model, ids)
    bounds = {"f16": 2e-3, "bf16": 1.5e-2, "q8_0": 3e-2, "q4_0": 2.5e-1}
    for dtype, bound in bounds.items():
        file = jaxft.save_gguf(model, tmp_path / dtype / "model.gguf", dtype, tokenizer=tokenizer)
        reader = gguf.GGUFReader(str(file))
        kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}
        assert kinds == {dtype.upper()}, kinds
        hf = torch_logits(_hf_gguf(file), ids)
        err = rel_err(hf, ours)
        print(f"{dtype}: logits rel. error {err:.2e}")
        assert 0 < err < bound, (dtype, err)
        assert rel_err(jax_logits(jaxft.from_pretrained(file, dtype="float32", verbose=False), ids), hf) < 1e-5


def test_tokenizer_and_chat_template_round_trip(tmp_path, tokenizer):
    model = jaxft.from_pretrained(TOKENIZER, dtype="float32", verbose=False)
    file = jaxft.save_gguf(model, tmp_path / "tiny.gguf", "q8_0", tokenizer=TOKENIZER)
    back = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    text = "The quick brown fox, 42 times!\nNew line."
    assert back(text)["input_ids"] == tokenizer(text)["input_ids"]
    messages = [{"role": "user", "content": "hi there"}]
    assert (back.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    fields = {k: f.contents() for k, f in gguf.GGUFReader(str(file)).fields.items()}
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.bos_token_id"] == tokenizer.bos_token_id
    assert fields["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id
    assert fields["llama.context_length"] == 2048 and fields["llama.rope.dimension_count"] == 32


@pytest.mark.parametrize("model_type", list(gnames.FAMILIES))
def test_name_table_agrees_with_llama_cpp_tensor_map(model_type):
    fam = gnames.FAMILIES[model_type]
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == fam.arch)
    llama_cpp = gguf.get_tensor_name_map(arch, 2)
    known = {gguf.TENSOR_NAMES[t].replace("{bid}", "{i}") for t in gguf.MODEL_TENSORS[arch]}
    checked = 0
    for hf, ours in fam.modules:
        if ours not in known:  # a module the family never has (q_norm in Llama; Gemma 2's head is always tied)
            continue
        assert llama_cpp.get_name(hf.replace("{i}", "1")) == ours.replace("{i}", "1"), hf
        checked += 1
    assert checked >= 12


def test_unsupported_inputs_are_one_clear_error(tmp_path):
    model = jaxft.from_pretrained(TOKENIZER, dtype="float32", verbose=False)
    with pytest.raises(CheckpointError, match="q4_k.*choose one of f32, f16, bf16, q8_0"):
        jaxft.save_gguf(model, tmp_path / "a.gguf", "q4_k")
    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="architecture 'phi3' is not one jaxft loads"):
        jaxft.from_pretrained(tmp_path / "phi.gguf")
    jaxft.save_gguf(model, tmp_path / "b.gguf", "f16")
    with pytest.raises(CheckpointError, match="exists; pass overwrite=True"):
        jaxft.save_gguf(model, tmp_path / "b.gguf", "f16")
    scaled = model.config.replace(rope=model.config.rope.__class__(rope_type="dynamic", factor=2.0))
    with pytest.raises(CheckpointError, match="RoPE type 'dynamic'"):
        bgguf.write_gguf(tmp_path / "c.gguf", scaled.to_hf(), [], dtype="f16")


def test_training_key_writes_the_merged_model_as_gguf(tmp_path, ids):
    from jaxft.train import TrainConfig, TrainConfigError, train

    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "Q{i}: what is {i} + {i}?", "completion": " {2 * i}"}}\n'
                            for i in range(16)), encoding="utf-8")
    keys = dict(model_name_or_path=str(TOKENIZER), dataset=str(data), output_dir=str(tmp_path / "run"),
                max_seq_length=64, per_device_train_batch_size=2, max_steps=2, learning_rate=5e-2, bf16=False,
                disable_tqdm=True, report_to="none", lora_r=4, save_merged_model=True)
    with pytest.raises(TrainConfigError, match="key 'save_gguf'.*'q4_k' is not one of"):
        TrainConfig(**keys, save_gguf="q4_k")
    result = train(TrainConfig(**keys, save_gguf="f32"))
    assert result.gguf_file == tmp_path / "run" / "gguf" / "model-f32.gguf"
    merged = transformers.AutoModelForCausalLM.from_pretrained(result.merged_dir, dtype=torch.float32).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(TOKENIZER, dtype=torch.float32).eval()
    want = torch_logits(merged, ids)
    assert rel_err(torch_logits(base, ids), want) > 1e-3  # the run changed the model
    assert rel_err(torch_logits(_hf_gguf(result.gguf_file), ids), want) < 1e-5
    back = transformers.AutoTokenizer.from_pretrained(result.gguf_file.parent, gguf_file=result.gguf_file.name)
    assert back.chat_template is not None and back.eos_token_id == base.config.eos_token_id


def test_metadata_round_trips_what_gguf_carries_and_refuses_what_it_cannot(tmp_path):
    def config_of(model_type, **kw):
        hf = transformers.AutoConfig.for_model(model_type, **{**BASE, **kw}).to_dict()
        return jaxft.ModelConfig.from_hf(hf)

    cases = {
        "mistral": config_of("mistral", sliding_window=100),
        "yarn": config_of("llama", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5,
                                                    "original_max_position_embeddings": 256}),
        "gemma3": config_of("gemma3_text", sliding_window=24, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    }
    for name, cfg in cases.items():
        file = bgguf.write_gguf(tmp_path / f"{name}.gguf", cfg.to_hf(), [], dtype="f16")
        back = jaxft.ModelConfig.from_hf(bgguf.read_config(file))
        # no tensors were written, so tying (read from the absence of output.weight) is not compared
        assert back.replace(hf_json="", tie_word_embeddings=cfg.tie_word_embeddings) == cfg.replace(hf_json=""), name
    odd = config_of("gemma3_text", layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(CheckpointError, match="layer_types .* fixed pattern"):
        bgguf.write_gguf(tmp_path / "odd.gguf", odd.to_hf(), [], dtype="f16")


def test_gguf_base_quantised_to_nf4_on_load(tmp_path, tokenizer, ids):
    dense = jaxft.from_pretrained(TOKENIZER, dtype="float32", verbose=False)
    file = jaxft.save_gguf(dense, tmp_path / "tiny.gguf", "f32")
    nf4 = jaxft.from_pretrained(file, dtype="float32", quantize="nf4", verbose=False)
    want = jaxft.from_pretrained(TOKENIZER, dtype="float32", quantize="nf4", verbose=False)
    assert nf4.quant_config == want.quant_config and nf4.quant_skipped == want.quant_skipped
    got = jax_logits(nf4, ids)
    assert rel_err(got, jax_logits(want, ids)) < 1e-6  # the same weights, quantised alike
    assert rel_err(got, jax_logits(dense, ids)) > 1e-3  # and 4-bit indeed


def test_sentencepiece_style_tokenizer_round_trips_as_llama_model(tmp_path):
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"])}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "n")]
    for piece in [*"▁abcdefghijklmnopqrstuvwxyz", *(a + b for a, b in merges)]:
        vocab.setdefault(piece, len(vocab))
    tok = transformers.LlamaTokenizer(vocab=vocab, merges=merges)
    config = {**BASE, "model_type": "llama", "vocab_size": len(vocab) + 5}  # padded embedding rows
    file = bgguf.write_gguf(tmp_path / "spm.gguf", config, [], dtype="f16", tokenizer=tok)
    fields = {k: f.contents() for k, f in gguf.GGUFReader(str(file)).fields.items()}
    assert fields["tokenizer.ggml.model"] == "llama" and fields["tokenizer.ggml.add_space_prefix"] is True
    types = fields["tokenizer.ggml.token_type"]
    assert types[3:259] == [6] * 256 and types[-5:] == [5] * 5  # byte tokens, the padding rows
    assert types[:3] == [2, 3, 3]  # <unk> unknown, <s> </s> control
    back = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=file.name)
    text = "the cat in a hat! 9"
    assert back(text)["input_ids"] == tok(text)["input_ids"]
