"""Benchmark: the grouped matmul's fast implementations on the MoE expert shapes (shapes.BENCH_SHAPES), forward
and forward+backward (d lhs and d rhs), next to one dense matmul of the same FLOPs ("dense": [rows, K] @ [K, N]
with rows = sum(group_sizes), and its two gradients).

    python -m kernels_pallas.grouped_matmul.bench                       # every BENCH_SHAPE, xla / pallas_mosaic / dense
    python -m kernels_pallas.grouped_matmul.bench --impls pallas_mosaic --shapes gpt_oss_20b_down --json out.json
    python -m kernels_pallas.grouped_matmul.bench --smoke               # shapes.TEST_SHAPES[-1], CPU ok

TFLOP/s counts useful work only: forward 2 * rows * K * N, forward+backward three times that. Each
(implementation, shape) is compiled once, warmed up, then timed as the median of ``--iters`` calls with the
device synchronised before the clock is read; a failure prints its error and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from kernels_pallas._bench import median_ms

from .api import grouped_matmul
from .shapes import BENCH_SHAPES, TEST_SHAPES, GmmShape, make_inputs

IMPLS = ("xla", "pallas_mosaic", "dense")


def _programs(impl: str, shape: GmmShape):
    """(forward fn, forward+backward fn, args) for one implementation on one shape."""
    lhs, rhs, sizes, dout = make_inputs(shape)
    if impl == "dense":
        rows = sum(shape.group_sizes)
        args = (lhs[:rows], rhs[0], dout[:rows])
        fwd = lambda a, b, d: a @ b
    else:
        args = (lhs, rhs, dout, sizes)
        fwd = lambda a, b, d, s: grouped_matmul(a, b, s, implementation=impl)

    def fwd_bwd(*a):
        out, pullback = jax.vjp(lambda x, w: fwd(x, w, *a[2:]), a[0], a[1])
        return out, pullback(a[2])

    return jax.jit(fwd), jax.jit(fwd_bwd), args


def run(shapes: Sequence[GmmShape] = BENCH_SHAPES, impls: Sequence[str] = IMPLS, iters: int = 10) -> list[dict]:
    rows = []
    for shape in shapes:
        flops = 2.0 * sum(shape.group_sizes) * shape.k * shape.n
        for impl in impls:
            row = {"shape": shape.name, "impl": impl, "m": shape.m, "k": shape.k, "n": shape.n,
                   "groups": len(shape.group_sizes), "rows": sum(shape.group_sizes)}
            try:
                fwd, fwd_bwd, args = _programs(impl, shape)
                for mode, fn, work in (("fwd", fwd, flops), ("fwd_bwd", fwd_bwd, 3 * flops)):
                    ms = median_ms(fn.lower(*args).compile(), args, iters)
                    row[f"{mode}_ms"] = ms
                    row[f"{mode}_tflops"] = work / (ms * 1e-3) / 1e12
            except Exception as e:  # noqa: BLE001 - one failure must not lose the other rows
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
                traceback.print_exc()
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _line(r: dict) -> str:
    if "error" in r and "fwd_ms" not in r:
        return f"{r['shape']:<24} {r['impl']:<14} ERROR {r['error'].splitlines()[0][:300]}"
    cells = []
    for mode in ("fwd", "fwd_bwd"):
        if f"{mode}_ms" in r:
            cells.append(f"{mode} {r[f'{mode}_ms']:9.3f} ms {r[f'{mode}_tflops']:7.1f} TFLOP/s")
        else:
            cells.append(f"{mode} ERROR {r.get('error', '').splitlines()[0][:200]}")
    return f"{r['shape']:<24} {r['impl']:<14} " + "  ".join(cells)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="one small test shape (CPU ok)")
    ap.add_argument("--shapes", default=",".join(s.name for s in BENCH_SHAPES))
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None, help="write the rows here as JSON")
    args = ap.parse_args(argv)
    known = {s.name: s for s in BENCH_SHAPES}
    names = [s for s in args.shapes.split(",") if s]
    if unknown := [s for s in names if s not in known]:
        ap.error(f"unknown --shapes {unknown}; known: {sorted(known)}")
    if bad := [i for i in args.impls.split(",") if i and i not in IMPLS]:
        ap.error(f"unknown --impls {bad}; known: {list(IMPLS)}")
    impls = [i for i in args.impls.split(",") if i]
    if args.smoke:  # the interpreter on CPU: the kernels run, the timings mean nothing
        shape = TEST_SHAPES[-1]
        shapes = [shape]
        impls = [i for i in impls if i != "pallas_mosaic" or jnp.dtype(shape.dtype) == jnp.bfloat16]
    else:
        shapes = [known[s] for s in names]
    print(f"devices: {jax.devices()}", flush=True)
    rows = run(shapes, impls, args.iters)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"devices": [str(d) for d in jax.devices()], "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
