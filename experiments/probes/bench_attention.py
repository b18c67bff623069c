"""Benchmark attention implementations (reference, cuDNN, jaxft Pallas) on the GPU.

Usage: python -m experiments.probes.bench_attention --out docs/results/attention_h200.json
Writes the JSON to --out and a markdown table next to it (same stem, .md),
rewriting both after every shape so partial results survive a timeout.
Shapes come from kernels_pallas/attention/shapes.py (shared with the tests); implementation names
are those of kernels_pallas.attention.OP ("reference" was called "xla" in older result files).
Times are medians of --iters runs; TFLOP/s count only kept (unmasked) pairs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time
import traceback


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels_pallas.attention import dot_product_attention, make_metadata  # noqa: E402
from kernels_pallas.attention.metadata import kept_pairs  # noqa: E402
from kernels_pallas.attention.shapes import BENCH_SHAPES, AttnShape, make_segment_ids  # noqa: E402
from kernels_pallas.attention.config import BlockConfig, FlashConfig  # noqa: E402
from kernels_pallas.attention.config import default_flash_config  # noqa: E402
from kernels_pallas.attention.cudnn import cudnn_attention  # noqa: E402
from kernels_pallas.attention.flash import flash_attention  # noqa: E402

IMPLS = ("reference", "cudnn", "pallas")
REFERENCE_MAX_SCORE_BYTES = 24 * 2**30  # skip the reference when one fp32 [B,H,T,T] score tensor exceeds this



def useful_flops(shape: AttnShape, segment_ids: np.ndarray) -> tuple[float, float]:
    """(forward, forward+backward) FLOPs counting only kept score entries.

    Forward: 2 matmuls (QK^T, PV) = 4 * D flops per kept pair per head.
    Backward: 5 matmuls (QK^T recompute, dV, dP, dQ, dK) = 10 * D.
    """
    pairs = kept_pairs(segment_ids, window=shape.window)
    fwd = 4.0 * shape.head_dim * shape.heads * pairs
    return fwd, fwd * 3.5

def _time(fn, args, iters):
    out = fn(*args)
    jax.block_until_ready(out)  # compile + first run
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


def _attn_fn(impl, shape, seg_arr, n_runs, config=None):
    window = shape.window
    packed = shape.layout == "packed"

    def attn(q, k, v, meta):
        if impl == "cudnn":
            return cudnn_attention(q, k, v, segment_ids=seg_arr if packed else None,
                                   causal=True, sliding_window=window,
                                   max_segments=n_runs if packed else None)
        if impl == "pallas" and config is not None:
            return flash_attention(q, k, v, meta, causal=True, sliding_window=window, config=config)
        return dot_product_attention(
            q, k, v, segment_ids=seg_arr if packed else None,
            metadata=meta if impl == "pallas" else None, causal=True,
            sliding_window=window, implementation=impl)

    return attn


def _inputs(shape):
    b, t, h, kvh, d = shape.batch, shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, h, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, kvh, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, kvh, d), jnp.bfloat16)
    do = jax.random.normal(keys[3], (b, t, h, d), jnp.bfloat16)
    return q, k, v, do


# Candidate tilings (block_q, block_k, num_warps, num_stages) for the sweep.
FWD_CANDIDATES = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 128, 4, 3)]
DQ_CANDIDATES = [(64, 64, 4, 2), (128, 32, 4, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 32, 4, 3)]
DKDV_CANDIDATES = [(64, 64, 8, 2), (32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3)]


def tune_pallas(shape, iters):
    """Greedy sweep on one shape: best forward tiling (fwd time), then best dQ
    and best dK/dV tiling (fwd+bwd time).  Returns (FlashConfig, log)."""
    q, k, v, do = _inputs(shape)
    seg = jnp.asarray(make_segment_ids(shape, seed=0))
    meta = make_metadata(seg, causal=True, sliding_window=shape.window)
    cfg = default_flash_config(shape.head_dim)
    log = []

    def measure(c, with_bwd):
        attn = _attn_fn("pallas", shape, seg, 0, config=c)
        if not with_bwd:
            return _time(jax.jit(attn), (q, k, v, meta), iters)[0]

        def fb(q, k, v, meta, do):
            o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, meta), q, k, v)
            return o, vjp(do)

        return _time(jax.jit(fb), (q, k, v, meta, do), iters)[0]

    for field, cands, with_bwd in (("fwd", FWD_CANDIDATES, False), ("dq", DQ_CANDIDATES, True),
                                   ("dkdv", DKDV_CANDIDATES, True)):
        best = None
        for cand in cands:
            try:
                c = FlashConfig(**{**cfg.__dict__, field: BlockConfig(*cand)})
                s = measure(c, with_bwd)
            except Exception as e:  # e.g. out of shared memory for this tiling
                log.append(dict(kernel=field, tiling=cand, error=f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            log.append(dict(kernel=field, tiling=cand, ms=s * 1e3))
            print(json.dumps(log[-1]), flush=True)
            if best is None or s < best[0]:
                best = (s, c)
        if best is not None:
            cfg = best[1]
    return cfg, log


def bench_shape(shape, impls, iters, config=None):
    b, t, h = shape.batch, shape.seq_len, shape.heads
    seg_np = make_segment_ids(shape, seed=0)
    n_runs = int(max((np.diff(r) != 0).sum() + 1 for r in seg_np))
    flops_f, flops_fb = useful_flops(shape, seg_np)
    q, k, v, do = _inputs(shape)
    seg = jnp.asarray(seg_np)
    mk = jax.jit(lambda s: make_metadata(s, causal=True, sliding_window=shape.window))
    meta_s, meta = _time(mk, (seg,), iters)
    row = dict(shape=shape.__dict__, tokens=b * t, max_segments_per_row=n_runs,
               useful_tflop_fwd=flops_f / 1e12, useful_tflop_fwd_bwd=flops_fb / 1e12,
               metadata_ms=meta_s * 1e3, results={})
    outs = {}
    for impl in impls:
        res = {}
        if impl == "reference" and b * h * t * t * 4 > REFERENCE_MAX_SCORE_BYTES:
            res["skipped"] = "fp32 score matrix would exceed the memory budget"
            row["results"][impl] = res
            continue
        attn = _attn_fn(impl, shape, seg, n_runs, config=config)
        try:
            fwd = jax.jit(attn)
            s, o = _time(fwd, (q, k, v, meta), iters)
            res.update(fwd_ms=s * 1e3, fwd_tflops=flops_f / s / 1e12)
            outs[impl] = o

            def fb(q, k, v, meta, do):
                o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, meta), q, k, v)
                return o, vjp(do)

            s, _ = _time(jax.jit(fb), (q, k, v, meta, do), iters)
            res.update(fwd_bwd_ms=s * 1e3, fwd_bwd_tflops=flops_fb / s / 1e12)
        except Exception as e:  # record and keep benchmarking the other columns
            res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            traceback.print_exc(limit=3)
        row["results"][impl] = res
    if "pallas" in outs:
        ref_name = "reference" if "reference" in outs else ("cudnn" if "cudnn" in outs else None)
        if ref_name:
            err = jnp.max(jnp.abs(outs["pallas"].astype(jnp.float32) - outs[ref_name].astype(jnp.float32)))
            row["pallas_max_abs_err"] = {"vs": ref_name, "value": float(err)}
    return row


def to_markdown(rows, device, config=None):
    lines = [f"Attention benchmark on {device} (bf16, H=32, KV=8, D=128; median times; "
             "TFLOP/s count only unmasked score entries).", "",
             "| shape | B x T | metadata ms | " + " | ".join(
                 f"{i} fwd ms (TFLOP/s)" for i in IMPLS) + " | " + " | ".join(
                 f"{i} fwd+bwd ms (TFLOP/s)" for i in IMPLS) + " |",
             "|" + "---|" * (3 + 2 * len(IMPLS))]
    for r in rows:
        sh = r["shape"]

        def cell(impl, key):
            res = r["results"].get(impl, {})
            if f"{key}_ms" in res:
                return f"{res[f'{key}_ms']:.2f} ({res[f'{key}_tflops']:.0f})"
            if "skipped" in res:
                return "skipped (OOM)"
            if "error" in res:
                return "error"
            return "-"

        lines.append(
            f"| {sh['name']} | {sh['batch']} x {sh['seq_len']} | {r['metadata_ms']:.2f} | "
            + " | ".join(cell(i, "fwd") for i in IMPLS) + " | "
            + " | ".join(cell(i, "fwd_bwd") for i in IMPLS) + " |")
    errs = [f"{r['shape']['name']}: {r['pallas_max_abs_err']['value']:.3g} vs {r['pallas_max_abs_err']['vs']}"
            for r in rows if "pallas_max_abs_err" in r]
    if errs:
        lines += ["", "Pallas forward max |err| (bf16 outputs): " + "; ".join(errs)]
    if config:
        lines += ["", f"Pallas tiling (block_q, block_k, warps, stages): {json.dumps(config)}"]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True, help="path of the JSON result file (.md written alongside)")
    ap.add_argument("--shapes", default=",".join(s.name for s in BENCH_SHAPES))
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tune-shape", default="",
                    help="sweep Pallas tilings on this shape first and benchmark with the winner")
    ap.add_argument("--time-budget-s", type=float, default=1e9,
                    help="stop starting new shapes after this many seconds")
    args = ap.parse_args(argv)
    names = args.shapes.split(",")
    unknown = set(names) - {s.name for s in BENCH_SHAPES}
    if unknown:
        ap.error(f"unknown shapes {sorted(unknown)}; known: {[s.name for s in BENCH_SHAPES]}")
    impls = tuple(args.impls.split(","))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    device = str(jax.devices()[0].device_kind)
    rows, t0 = [], time.time()
    config, tune_log = None, []
    if args.tune_shape and "pallas" in impls:
        config, tune_log = tune_pallas(next(s for s in BENCH_SHAPES if s.name == args.tune_shape),
                                       args.iters)
    cfg_json = None if config is None else dataclasses.asdict(config)
    for shape in BENCH_SHAPES:
        if shape.name not in names:
            continue
        if time.time() - t0 > args.time_budget_s:
            print(f"time budget exhausted; skipping {shape.name}", flush=True)
            continue
        row = bench_shape(shape, impls, args.iters, config=config)
        rows.append(row)
        print(json.dumps(row), flush=True)
        out.write_text(json.dumps(dict(device=device, jax=jax.__version__, pallas_config=cfg_json,
                                       tuning=tune_log, rows=rows), indent=1))
        out.with_suffix(".md").write_text(to_markdown(rows, device, cfg_json))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
