"""llama3 RoPE (Llama 3.1+) in GGUF: llama.cpp keeps it as a `rope_freqs.weight` tensor of per-pair frequency
divisors, not as metadata. transformers' GGUF loader ignores that tensor (it reads the file as default RoPE), so
the oracle of the writer is transformers' own llama3 RoPE (the default inverse frequencies over the llama3 ones are
the divisors) and the gguf package's reader; jaxft reads the tensor back into the RoPE parameters, and the model it
loads from the file computes the original model's logits in transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import jaxft
from bridge import CheckpointError
from bridge import gguf as bgguf
from lora_helpers import jax_logits, rel_err, torch_logits

gguf = pytest.importorskip("gguf")

# head_dim 16 at theta 1e4: wavelengths 6.3, 20, 63, 199, 628, ... so that with a context of 256 and the high
# factor 16 one pair keeps its frequency (under 16), three are blended (16 .. 256), four divided by the factor.
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 16.0, "original_max_position_embeddings": 256}
CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-6,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rope_parameters=LLAMA3)


def _divisors(config) -> np.ndarray:
    """transformers' default inverse frequencies over its llama3 ones."""
    default, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    return (default.double() / scaled.double()).numpy()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    config = transformers.LlamaConfig(**CONFIG)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama3")
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def test_llama3_rope_is_written_as_rope_freqs_and_read_back(hf_dir, tmp_path):
    model = jaxft.from_pretrained(hf_dir, dtype="float32", verbose=False)
    file = jaxft.save_gguf(model, tmp_path / "model.gguf", "f32")
    reader = gguf.GGUFReader(str(file))
    (freqs,) = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
    assert freqs.tensor_type == gguf.GGMLQuantizationType.F32
    got = np.asarray(freqs.data, np.float64)
    want = _divisors(transformers.LlamaConfig(**CONFIG))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.sum(got == 1) == 1 and np.sum(got == 8) == 4 and np.sum((got > 1) & (got < 8)) == 3
    assert "llama.rope.scaling.type" not in reader.fields  # scaling metadata would scale llama.cpp's RoPE twice

    back = jaxft.from_pretrained(file, dtype="float32", verbose=False)
    assert back.config.rope == model.config.rope
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(3, 256, (1, 600))  # past the original context of 256
    want_logits = torch_logits(hf, ids)
    assert rel_err(jax_logits(back, ids), want_logits) < 1e-5
    # transformers' GGUF loader drops the tensor: its model of the file has default RoPE, another model
    read = transformers.AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    assert (read.rope_parameters or {}).get("rope_type", "default") == "default"


def test_a_llama_cpp_file_without_the_context_length_reads_as_the_same_frequencies(tmp_path):
    """llama.cpp's converter writes the tensor alone: the context length is taken as 8192 and the two factors
    follow from it (only their ratios to the context shape the frequencies)."""
    file = _metadata_only(tmp_path / "cpp.gguf", bgguf.llama3_rope_factors(LLAMA3, 16))
    rope = bgguf.read_config(file)["rope_parameters"]
    assert rope["rope_type"] == "llama3" and rope["original_max_position_embeddings"] == 8192
    assert rope["factor"] == 8.0
    assert rope["low_freq_factor"] == pytest.approx(32.0) and rope["high_freq_factor"] == pytest.approx(512.0)
    np.testing.assert_allclose(bgguf.llama3_rope_factors(rope, 16), bgguf.llama3_rope_factors(LLAMA3, 16),
                               rtol=1e-5)


def test_what_cannot_be_written_or_recovered_is_one_line(tmp_path):
    qwen = {**transformers.Qwen2Config(**{k: v for k, v in CONFIG.items() if k != "head_dim"}).to_dict(),
            "rope_parameters": LLAMA3}
    with pytest.raises(CheckpointError, match="llama3 RoPE is a rope_freqs tensor .* not 'qwen2'"):
        bgguf.write_gguf(tmp_path / "q.gguf", qwen, [], dtype="f16")
    # one blended pair cannot fix two factors
    file = _metadata_only(tmp_path / "odd.gguf", np.array([1, 1, 1, 2, 8, 8, 8, 8], np.float32))
    with pytest.raises(CheckpointError, match=r"rope_freqs.weight is not a llama3 RoPE scaling jaxft can recover") \
            as info:
        bgguf.read_config(file)
    assert "\n" not in str(info.value)


def _metadata_only(path: Path, factors: np.ndarray) -> Path:
    """A llama GGUF file as llama.cpp's converter writes llama3 RoPE: the sizes, and the rope_freqs tensor."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("embedding_length", 64), ("block_count", 2), ("feed_forward_length", 96),
                       ("attention.head_count", 4), ("attention.head_count_kv", 2), ("vocab_size", 256),
                       ("rope.dimension_count", 16)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_tensor("rope_freqs.weight", factors, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
