"""Decode throughput of jaxft.generation vs transformers' generate, on random-weight bf16 models.

    python -m experiments.probes.bench_generate [--shapes 1b,8b | tiny] [--systems jaxft,hf] [--batch 1,16]
                                     [--prompt-len 128] [--new-tokens 256] [--out results.json]

For each shape (scripts/bench/workloads.py SHAPES: llama-3.2-1b, llama-3.1-8b; `tiny` = tiny-llama for a CPU
smoke run) a model directory with random weights is made once (scripts/bench/models.py) and loaded by each
system. Greedy decoding of random prompt tokens with EOS disabled, so every row decodes the full length.
Per (system, batch): one warm-up call (compiles / warms kernels), then a timed prefill-only call
(max_new_tokens=1) and a timed full call, with a device sync before each clock read:

    prefill_s = time of the 1-token call;  decode_s = full call - prefill_s
    decode tokens/s = batch * (new_tokens - 1) / decode_s

transformers runs `AutoModelForCausalLM.generate` in torch bf16 on cuda (or CPU for `tiny`) with its default
dynamic cache, or a static cache with --hf-cache static (cache_implementation="static", no torch.compile).
Prints one JSON object (all rows) and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

# Both systems share the GPU in one process: JAX must not take 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from scripts.bench.models import save_random_model  # noqa: E402
from scripts.bench.workloads import SHAPES  # noqa: E402

SHAPE_SETS = {"1b": ["llama-3.2-1b"], "8b": ["llama-3.1-8b"], "tiny": ["tiny-llama"]}


def _prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(4, vocab, (batch, length)).tolist()  # ids 0..3 are the special tokens


def bench_jaxft(model_dir: str, batch: int, prompt_len: int, new_tokens: int) -> dict:
    import jaxft
    from jaxft.generation import run_generation

    model = jaxft.from_pretrained(model_dir, dtype="bfloat16")
    prompts = _prompts(batch, prompt_len, model.config.vocab_size)
    kw = dict(stop_token_ids=[])  # EOS disabled: every row decodes new_tokens tokens
    run_generation(model, prompts, max_new_tokens=1, **kw)  # warm-up (compiles both stages of both shapes)
    run_generation(model, prompts, max_new_tokens=new_tokens, **kw)
    prefill = run_generation(model, prompts, max_new_tokens=1, timed=True, **kw)
    full = run_generation(model, prompts, max_new_tokens=new_tokens, timed=True, **kw)
    assert all(len(row) == new_tokens for row in full.ids), "a row stopped early"
    prefill_s = prefill.prefill_s + prefill.decode_s  # the 1-token call, timed like the full one
    return _row("jaxft", batch, prompt_len, new_tokens, prefill_s, full.prefill_s + full.decode_s,
                note="prefill + while_loop decode, static KV cache")


def bench_hf(model_dir: str, batch: int, prompt_len: int, new_tokens: int, cache: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                 trust_remote_code=False).to(device).eval()
    ids = torch.tensor(_prompts(batch, prompt_len, model.config.vocab_size), device=device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None,
              pad_token_id=model.config.pad_token_id)
    if cache == "static":
        kw["cache_implementation"] = "static"

    def timed(n: int) -> float:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        sync()
        assert out.shape[1] == prompt_len + n
        return time.perf_counter() - t0

    timed(1)  # warm-up
    timed(new_tokens)
    prefill_s = timed(1)
    return _row("transformers", batch, prompt_len, new_tokens, prefill_s, timed(new_tokens),
                note=f"generate, torch bf16 {device}, {cache} cache")


def _row(system, batch, prompt_len, new_tokens, prefill_s, total_s, note) -> dict:
    decode_s = max(total_s - prefill_s, 1e-9)
    return dict(system=system, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, prefill_s=prefill_s,
                decode_s=decode_s, decode_tokens_per_s=batch * (new_tokens - 1) / decode_s,
                total_s=total_s, note=note)


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | system | batch | prefill ms | decode s | decode tokens/s | note |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['system']} | {r['batch']} | {r['prefill_s'] * 1e3:.1f} | "
                     f"{r['decode_s']:.3f} | {r['decode_tokens_per_s']:.0f} | {r['note']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1b,8b", help=f"comma list of {sorted(SHAPE_SETS)}")
    p.add_argument("--systems", default="jaxft,hf")
    p.add_argument("--batch", default="1,16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--hf-cache", choices=("dynamic", "static"), default="dynamic")
    p.add_argument("--workdir", help="where model directories go (default: a temp dir)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPE_SETS]
    if unknown:
        p.error(f"--shapes: unknown {unknown}; choose from {sorted(SHAPE_SETS)}")
    systems = args.systems.split(",")
    if set(systems) - {"jaxft", "hf"}:
        p.error(f"--systems: choose from jaxft, hf; got {args.systems}")
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (one token comes from the prefill)")
    batches = [int(b) for b in args.batch.split(",")]
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_generate_")
    rows = []
    for shape_name in [n for s in args.shapes.split(",") for n in SHAPE_SETS[s]]:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        model_dir = os.path.join(workdir, shape_name)
        save_random_model(SHAPES[shape_name], model_dir, device)
        for batch in batches:
            if "jaxft" in systems:
                rows.append({"shape": shape_name, **bench_jaxft(model_dir, batch, args.prompt_len, args.new_tokens)})
            if "hf" in systems:
                rows.append({"shape": shape_name, **bench_hf(model_dir, batch, args.prompt_len, args.new_tokens,
                                                              args.hf_cache)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {"rows": rows, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    print(json.dumps(result))
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
