"""Generation with a KV cache (jaxft.generation, jaxft-generate) against transformers' / PEFT's generate.

Tiny random models are built with transformers here, saved, and loaded with jaxft.from_pretrained in fp32;
greedy tokens must equal `model.generate(do_sample=False)` run on each prompt alone, while jaxft batches
prompts of different lengths (one >= 512 tokens so RoPE errors show). The chat/text path and the CLI use
examples/tiny-llama, which has a real tokenizer, chat template and generation_config.json.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import jaxft
from jaxft import generate_cli
from jaxft.generation import engine, generate_ids
from jaxft.generation.text import encode_prompt
from jaxft.models.decoder import is_unstacked
from jaxft.train.step import split_model, unstack_layers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_LLAMA = os.path.join(REPO, "examples", "tiny-llama")
VOCAB = 256
NEW = 10
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6)
VARIANTS = {
    "llama3_gqa": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 128})),
    "mistral_window": ("mistral", dict(sliding_window=24)),
    "qwen2_bias_window_layers": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1,
                                               layer_types=["sliding_attention", "full_attention"])),
    "llama_dynamic_beyond_max": ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0},
                                               max_position_embeddings=48)),
}
LENGTHS = {"llama3_gqa": (5, 37, 530)}  # others: short and longer than their windows / max positions
# q/k norms and a tied head in the decode steps: test_gemma.test_greedy_generation_matches_transformers (Gemma 3).


def _hf_model(model_type, overrides, seed=0):
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases, so a mis-used one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model.eval()


def _hf_generate(model, ids, new=NEW):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=new)
    return out[0, len(ids):].tolist()


def _prompts(lengths, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, VOCAB, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    model_type, overrides = VARIANTS["llama3_gqa"]
    hf = _hf_model(model_type, overrides)
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    return hf, path


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_matches_transformers_on_a_batch_of_different_lengths(name, llama, tmp_path):
    if name == "llama3_gqa":
        hf, path = llama
    else:
        hf = _hf_model(*VARIANTS[name])
        path = tmp_path / name
        hf.save_pretrained(path)
    prompts = _prompts(LENGTHS.get(name, (3, 61)))
    got = generate_ids(jaxft.from_pretrained(path, dtype="float32"), prompts, max_new_tokens=NEW)
    want = [_hf_generate(hf, p) for p in prompts]
    assert got == want
    assert all(len(row) == NEW for row in got)  # hf's default eos (2) never came: every token was compared


def test_lora_adapter_matches_peft_generate(llama, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    _, path = llama
    peft_model = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        torch.manual_seed(5)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)  # B = 0 at init: the adapter would change nothing
    peft_model.save_pretrained(tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    prompts = _prompts((7, 40), seed=2)
    model = jaxft.load_adapter(jaxft.from_pretrained(path, dtype="float32"), tmp_path / "adapter")
    got = generate_ids(model, prompts, max_new_tokens=NEW)
    assert got == [_hf_generate(reference, p) for p in prompts]
    with reference.disable_adapter():  # the base's continuation (jaxft's equals it: the test above)
        assert got != [_hf_generate(reference, p) for p in prompts]  # the adapter acts

    # The training loop's view: nnx.merge(graphdef, lora, frozen) with per-layer (unstacked) frozen weights.
    graphdef, lora, frozen = split_model(model)
    unstacked = nnx.merge(graphdef, lora, unstack_layers(frozen))
    assert is_unstacked(nnx.state(unstacked.layers))
    assert generate_ids(unstacked, prompts, max_new_tokens=NEW) == got


def test_stop_tokens_end_rows_and_are_kept_in_ids(llama):
    _, path = llama
    model = jaxft.from_pretrained(path, dtype="float32")
    prompts = _prompts((9, 30), seed=3)
    full = generate_ids(model, prompts, max_new_tokens=NEW, stop_token_ids=[])
    stop = full[0][3]
    got = generate_ids(model, prompts, max_new_tokens=NEW, stop_token_ids=[stop])
    for row, want in zip(got, full):
        cut = want.index(stop) + 1 if stop in want else len(want)
        assert row == want[:cut]
    assert len(got[0]) <= 4


def test_sampling_is_seeded_and_tiny_top_p_is_greedy(llama):
    _, path = llama
    model = jaxft.from_pretrained(path, dtype="float32")
    prompts = _prompts((6, 20), seed=4)
    kw = dict(max_new_tokens=NEW, temperature=1.0, stop_token_ids=[])
    a, b = generate_ids(model, prompts, seed=7, **kw), generate_ids(model, prompts, seed=7, **kw)
    assert a == b
    assert generate_ids(model, prompts, seed=8, **kw) != a
    greedy = generate_ids(model, prompts, max_new_tokens=NEW, stop_token_ids=[])
    assert a != greedy  # random model, 256 tokens: sampling at temperature 1 differs from argmax
    assert generate_ids(model, prompts, seed=7, top_p=1e-6, **{**kw, "temperature": 0.7}) == greedy


def test_calls_in_one_bucket_reuse_the_compiled_programs(llama):
    _, path = llama
    model = jaxft.from_pretrained(path, dtype="float32")
    prefill, decode = engine._programs(jax.default_backend() != "cpu")
    generate_ids(model, _prompts((10, 20, 3)), max_new_tokens=4)
    sizes = prefill._cache_size(), decode._cache_size()
    generate_ids(model, _prompts((50, 2, 64, 33), seed=9), max_new_tokens=4)  # batch 4, prompt bucket 64
    assert (prefill._cache_size(), decode._cache_size()) == sizes
    generate_ids(model, _prompts((65,)), max_new_tokens=4)  # next prompt bucket: one new program each
    assert (prefill._cache_size(), decode._cache_size()) == (sizes[0] + 1, sizes[1] + 1)


def test_bad_arguments_name_the_fix(llama):
    _, path = llama
    model = jaxft.from_pretrained(path, dtype="float32")
    with pytest.raises(engine.GenerationError, match="prompt 1 has token id 999 outside"):
        generate_ids(model, [[1, 2], [999]])
    with pytest.raises(engine.GenerationError, match="top_p must be in"):
        generate_ids(model, [[1, 2]], top_p=0.0)


# ------------------------------------------------------------------------------------------------ text + chats


@pytest.fixture(scope="module")
def tiny_llama():
    return jaxft.from_pretrained(TINY_LLAMA, dtype="float32"), transformers.AutoTokenizer.from_pretrained(TINY_LLAMA)


def test_chat_and_text_prompts_match_transformers(tiny_llama):
    model, tok = tiny_llama
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    text = "The capital of France is"
    got = jaxft.generate(model, tok, [chat, text], max_new_tokens=24)
    assert jaxft.generate(model, tok, chat, max_new_tokens=24) == got[:1]  # a single conversation

    hf = transformers.AutoModelForCausalLM.from_pretrained(TINY_LLAMA, dtype=torch.float32).eval()
    chat_ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert encode_prompt(tok, chat) == list(chat_ids)
    assert encode_prompt(tok, text)[0] == tok.bos_token_id
    want = []
    for ids in (list(chat_ids), tok(text)["input_ids"]):
        with torch.no_grad():  # generation_config.json: stops on <|eot_id|> (3) and <|end_of_text|> (2)
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24)[0, len(ids):]
        want.append(tok.decode(out, skip_special_tokens=True))
    assert got == want
    assert got[0].strip()  # the example model was trained on chats: it answers something


def _cli(capsys, *argv):
    rc = generate_cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_prompts_file_json_and_stats(tiny_llama, tmp_path, capsys):
    model, tok = tiny_llama
    prompts = tmp_path / "prompts.jsonl"
    chat = [{"role": "user", "content": "Name a color."}]
    prompts.write_text(json.dumps({"prompt": "What is 2+2?"}) + "\n\n" + json.dumps({"messages": chat}) + "\n")
    rc, out, err = _cli(capsys, TINY_LLAMA, "--file", str(prompts), "--json", "--max-new-tokens", "16",
                        "--dtype", "float32", "--stats")
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    want = jaxft.generate(model, tok, [[{"role": "user", "content": "What is 2+2?"}], chat], max_new_tokens=16)
    assert [r["completion"] for r in rows] == want
    stats = json.loads(err.split("stats: ", 1)[1])
    assert stats["decode_tokens_per_s"] > 0 and stats["prefill_s"] > 0

    rc, out, _ = _cli(capsys, TINY_LLAMA, "--prompt", "What is 2+2?", "--prompt", "Hi", "--no-chat-template",
                      "--max-new-tokens", "16", "--dtype", "float32")
    assert rc == 0
    plain = jaxft.generate(model, tok, ["What is 2+2?", "Hi"], max_new_tokens=16)
    assert out == "".join(f"### prompt {i + 1}\n{t}\n\n" for i, t in enumerate(plain))


def test_cli_bad_inputs_are_one_line_with_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no"}) + "\n")
    cases = [
        ((str(tmp_path / "missing"), "--prompt", "x"), "missing: not a model directory"),
        ((str(tmp_path), "--prompt", "x"), "not a model directory (no config.json)"),
        ((TINY_LLAMA, "--file", str(bad)), f"{bad}:2: expected"),
        ((TINY_LLAMA, "--prompt", "x", "--adapter", str(tmp_path)), "no adapter_config.json"),
        ((TINY_LLAMA, "--prompt", "x", "--top-p", "2"), "top_p must be in (0, 1]"),
    ]
    for argv, message in cases:
        rc, out, err = _cli(capsys, *argv)
        assert rc == 2 and out == ""
        assert len(err.strip().splitlines()) == 1 and message in err, err
