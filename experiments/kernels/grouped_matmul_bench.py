"""Benchmark: the grouped matmul's fast implementations on the MoE expert shapes (shapes.BENCH_SHAPES), forward
and forward+backward (d lhs and d rhs), next to one dense matmul of the same FLOPs ("dense": [rows, K] @ [K, N]
with rows = sum(group_sizes), and its two gradients).

    python -m experiments.kernels.grouped_matmul_bench            # every BENCH_SHAPE, xla / pallas_mosaic / dense
    python -m experiments.kernels.grouped_matmul_bench --impls pallas_mosaic --shapes gpt_oss_20b_down --json out.json
    python -m experiments.kernels.grouped_matmul_bench --smoke               # shapes.TEST_SHAPES[-1], CPU ok
    python -m experiments.kernels.grouped_matmul_bench --against ab_base --rounds 4   # this tree's kernels vs another's
    python -m experiments.kernels.grouped_matmul_bench --sweep --json sweep.json      # row-kernel tiles per shape
    python -m experiments.kernels.grouped_matmul_bench --sweep --table-variants      # the table's tiles, variants only
    python -m experiments.kernels.grouped_matmul_bench --probe --shapes qwen3_30b_a3b_down   # where its time goes
    python -m experiments.kernels.grouped_matmul_bench --probe --probe-variant stages=4 --probe-variant grid_block_n=1

``--sweep``: the row-tile kernel (forward and d lhs) of every bench shape on each of ``sweep_candidates``' tile
configs and the d rhs kernel on ``sweep_dw_candidates``', next to the table's own (``tiles.CONFIGS``): the data the
table is chosen from, in one call.

``--against DIR``: an A/B of this tree's Mosaic GPU kernels against those of another tree (DIR holds its
``kernels_pallas``, e.g. ``git archive <rev> kernels_pallas | tar -x -C DIR``) in one process, alternating which runs
first in each round. Why: in two benches run one after the other on the H200, whichever ran first was up to 10%
faster on the same kernels (docs/benchmarks.md section 24), more than the changes being measured. Each version's
number is the median over the rounds of its per-round medians.

TFLOP/s counts useful work only: forward 2 * rows * K * N, forward+backward three times that. Each
(implementation, shape) is compiled once, warmed up, then timed as the kernels' own throughput: ``--iters`` calls
queued back to back and the device synchronised once after the last, the median over 5 such rounds of the time per
call (`queued_ms`). Until 2026-12-04 (docs/benchmarks.md sections 13-31) each call was
synchronised on its own, which also counted the host's dispatch and the wake-up after every sync (not yet
measured how much). A failure prints its error and the run goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.machinery
import importlib.util
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp


from kernels_pallas.grouped_matmul.api import grouped_matmul
from kernels_pallas.grouped_matmul.shapes import BENCH_SHAPES, TEST_SHAPES, GmmShape, make_inputs

IMPLS = ("xla", "pallas_mosaic", "dense")


def queued_ms(compiled: Callable, args: Sequence[jax.Array], reps: int = 20, rounds: int = 5,
              warmup: int = 2) -> float:
    """Median over ``rounds`` of the time per call of ``reps`` calls of ``compiled(*args)`` queued back to back,
    the device synchronised once after the last (its stream runs them in order, so the last one done is all done).
    Why: a kernel of about a millisecond timed one synchronised call at a time also pays the host's dispatch and
    the wake-up after each sync, which a training step, whose kernels queue behind each other, does not; this
    is the kernel's own throughput. Each call's outputs are dropped when the next replaces them."""
    if reps < 1 or rounds < 1 or warmup < 0:
        raise ValueError(f"experiments/kernels/grouped_matmul_bench.py: need reps, rounds >= 1 and warmup >= 0, "
                         f"got {reps}, {rounds}, {warmup}.")
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = None
        for _ in range(reps):
            out = compiled(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / reps)
    return 1e3 * sorted(per_call)[len(per_call) // 2]



def _programs(impl, shape: GmmShape):
    """(forward fn, forward+backward fn, args) for one implementation on one shape. `impl`: a name of IMPLS, or a
    grouped-matmul function gmm(lhs, rhs, group_sizes) (another tree's kernels, `run_against`)."""
    lhs, rhs, sizes, dout = make_inputs(shape)
    if impl == "dense":
        rows = sum(shape.group_sizes)
        args = (lhs[:rows], rhs[0], dout[:rows])
        fwd = lambda a, b, d: a @ b
    else:
        args = (lhs, rhs, dout, sizes)
        gmm = impl if callable(impl) else functools.partial(grouped_matmul, implementation=impl)
        fwd = lambda a, b, d, s: gmm(a, b, s)

    def fwd_bwd(*a):
        out, pullback = jax.vjp(lambda x, w: fwd(x, w, *a[2:]), a[0], a[1])
        return out, pullback(a[2])

    return jax.jit(fwd), jax.jit(fwd_bwd), args


def _row(shape: GmmShape, impl: str) -> dict:
    return {"shape": shape.name, "impl": impl, "m": shape.m, "k": shape.k, "n": shape.n,
            "groups": len(shape.group_sizes), "rows": sum(shape.group_sizes)}


def _work(shape: GmmShape) -> dict[str, float]:
    """Useful FLOPs per mode: forward 2 * rows * K * N, forward+backward three times that."""
    flops = 2.0 * sum(shape.group_sizes) * shape.k * shape.n
    return {"fwd": flops, "fwd_bwd": 3 * flops}


def _timed(row: dict, mode: str, work: float, ms: float) -> None:
    row[f"{mode}_ms"] = ms
    row[f"{mode}_tflops"] = work / (ms * 1e-3) / 1e12


def run(shapes: Sequence[GmmShape] = BENCH_SHAPES, impls: Sequence[str] = IMPLS, iters: int = 10,
        timing_rounds: int = 5) -> list[dict]:
    rows = []
    for shape in shapes:
        work = _work(shape)
        for impl in impls:
            row = _row(shape, impl)
            try:
                fwd, fwd_bwd, args = _programs(impl, shape)
                for mode, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
                    _timed(row, mode, work[mode], queued_ms(fn.lower(*args).compile(), args, iters, timing_rounds))
            except Exception as e:  # noqa: BLE001 - one failure must not lose the other rows
                row["error"] = f"{type(e).__name__}: {e}"[:2000]
                traceback.print_exc()
            rows.append(row)
            print(_line(row), flush=True)
    return rows


_AGAINST = "grouped_matmul_against"  # the package name another tree's kernels load under


def load_kernels(root: str):
    """The Mosaic GPU kernel module of another tree (``root/kernels_pallas/grouped_matmul/mosaic.py``), imported
    beside this tree's with its sibling modules (its kernels and tiles, which it imports relatively) from that tree,
    as the package ``grouped_matmul_against`` (whose ``__init__`` is not run); its imports of shared helpers
    (``kernels_pallas._dispatch``) resolve to this tree's."""
    folder = os.path.join(root, "kernels_pallas", "grouped_matmul")
    path = os.path.join(folder, "mosaic.py")
    if not os.path.isfile(path):
        raise SystemExit(f"--against {root}: no {path}; export a tree there first (git archive <rev> kernels_pallas "
                         f"| tar -x -C {root})")
    for name in [n for n in sys.modules if n == _AGAINST or n.startswith(_AGAINST + ".")]:
        del sys.modules[name]  # a second load (another root) must not reuse the first one's modules
    package = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(_AGAINST, None, is_package=True))
    package.__path__ = [folder]
    sys.modules[_AGAINST] = package  # registered first, as an import does (its dataclasses look their module up)
    return importlib.import_module(f"{_AGAINST}.mosaic")


def run_against(shapes: Sequence[GmmShape], other, rounds: int = 4, iters: int = 10) -> list[dict]:
    """Rows {"version": "this" | "against", ...} per shape: this tree's `grouped_matmul_mosaic` and `other`'s, timed
    in alternating order (round r runs "this" first when r is even)."""
    from kernels_pallas.grouped_matmul import mosaic

    versions = {"this": mosaic.grouped_matmul_mosaic, "against": other.grouped_matmul_mosaic}
    rows = []
    for shape in shapes:
        work = _work(shape)
        programs = {}
        for name, gmm in versions.items():
            fwd, fwd_bwd, args = _programs(gmm, shape)
            programs[name] = {"fwd": fwd.lower(*args).compile(), "fwd_bwd": fwd_bwd.lower(*args).compile()}, args
        times: dict[str, dict[str, list[float]]] = {name: {"fwd": [], "fwd_bwd": []} for name in versions}
        for r in range(rounds):
            for name in (("this", "against") if r % 2 == 0 else ("against", "this")):
                compiled, args = programs[name]
                for mode, fn in compiled.items():
                    times[name][mode].append(queued_ms(fn, args, iters, rounds=1))  # the A/B's own rounds
        for name in versions:
            row = {**_row(shape, f"mosaic:{name}"), "version": name, "rounds": rounds}
            for mode, per_round in times[name].items():
                _timed(row, mode, work[mode], sorted(per_round)[len(per_round) // 2])
                row[f"{mode}_ms_rounds"] = per_round
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def sweep_candidates(kc: int, n: int) -> list:
    """Warp-specialised row-kernel tiles for a product of contraction `kc` and output width `n` (bf16): the
    block_n widths that divide n, the stage counts that divide the contraction steps (so the units chain) and fit in
    shared memory (`tiles.smem_bytes`), both splits of the tile, and the two walks (along a tile's N-blocks, or
    down the tiles at one N-block); split along M also 256-row tiles (128 rows a compute warpgroup, as JAX's Hopper
    matmul example), which read each expert's tile once for twice the rows: for a short contraction (Qwen3-30B-A3B's
    down, K = 768) a 128 x 128 tile is 64 FLOPs per byte loaded. Why these: a width that does not divide n pads the
    whole expert stack, and an unchained pipeline fills from empty on every unit."""
    from kernels_pallas.grouped_matmul.tiles import _SMEM_BYTES, TileConfig, smem_bytes

    out = []
    for split, bm in (("m", 128), ("m", 256), ("n", 128)):
        for bn in (128, 192, 256):
            cta_n = 2 * bn if split == "n" else bn
            # A compute warpgroup's fp32 accumulator, (bm or bm / 2) x bn, must fit its registers: up to 128 x 128
            # (128 a thread) beside the rest, or 64 x 256.
            if n % cta_n or (bm if split == "n" else bm // 2) * bn > 128 * 128:
                continue
            for bk in (64, 128):
                if kc % bk:
                    continue
                tiles = dict(block_m=bm, block_n=bn, block_k=bk, warp_specialized=True, wg_split=split)
                fits = [st for st in (6, 5, 4, 3, 2) if (kc // bk) % st == 0
                        and smem_bytes(TileConfig(**tiles, stages=st)) <= _SMEM_BYTES]
                for stages in fits[:1]:  # the deepest ring that fits
                    for walk in (0, 1):
                        out.append(TileConfig(**tiles, stages=stages, grid_block_n=walk))
    return out


def two_block_candidates(kc: int, n: int) -> list:
    """Single-warpgroup row-kernel tiles run two blocks to an SM (TileConfig.blocks_per_sm = 2) for a product of
    contraction `kc` and output width `n` (bf16): 128 x 128, 128 x 192 and 64 x 256 output tiles whose width divides
    n, 64-deep steps, the deepest ring of 2 or more stages with which two blocks fit an SM's shared memory. (An
    accumulator of up to 192 floats a thread leaves two blocks of 128 threads within the SM's registers.)"""
    from kernels_pallas.grouped_matmul.tiles import TileConfig, blocks_fit, smem_bytes

    out = []
    for bm, bn in ((128, 128), (128, 192), (64, 256)):
        if n % bn or kc % 64:
            continue
        fits = [st for st in (4, 3, 2) if blocks_fit(smem_bytes(TileConfig(block_m=bm, block_n=bn, stages=st)), 2)]
        if fits:
            out.append(TileConfig(block_m=bm, block_n=bn, block_k=64, stages=fits[0], blocks_per_sm=2))
    return out


def multi_block_dw_candidates(k: int, n: int) -> list:
    """d rhs (group-tile kernel) tiles run two or three blocks to an SM (TileConfig.dw_blocks_per_sm): 128 x 128,
    128 x 192, 192 x 128 and 64 x 192 output tiles that divide k and n, 64-row steps, the deepest ring of 2 or more
    stages with which the blocks fit an SM's shared memory."""
    from kernels_pallas.grouped_matmul.tiles import TileConfig, blocks_fit, drhs_smem_bytes

    out = []
    for bk, bn in ((128, 128), (128, 192), (192, 128), (64, 192)):
        if k % bk or n % bn:
            continue
        for blocks in (2, 3):
            fits = [st for st in (4, 3, 2) if blocks_fit(drhs_smem_bytes(
                TileConfig(dw_block_k=bk, dw_block_n=bn, dw_stages=st)), blocks)]
            if fits:
                out.append(TileConfig(dw_block_k=bk, dw_block_n=bn, dw_block_t=64, dw_stages=fits[0],
                                      dw_blocks_per_sm=blocks))
    return out


def sweep_dw_candidates(k: int, n: int) -> list:
    """d rhs (group-tile kernel) tiles for lhs width `k` and dout width `n` (bf16): dw_block_k x dw_block_n output
    tiles that divide k and n, 64-row contraction steps, the deepest ring (of 6 or 4) that fits in shared memory."""
    from kernels_pallas.grouped_matmul.tiles import _SMEM_BYTES, TileConfig

    out = []
    for bk in (64, 128, 192):
        for bn in (128, 192, 256):
            if k % bk or n % bn or bk * bn > 192 * 128:  # fp32 [bk, bn] in one warpgroup: <= 192 registers a thread
                continue
            fits = [st for st in (6, 4) if st * 64 * (bk + bn) * 2 <= _SMEM_BYTES]
            if fits:
                out.append(TileConfig(dw_block_k=bk, dw_block_n=bn, dw_block_t=64, dw_stages=fits[0]))
    return out


def _describe_dw(cfg) -> str:
    blocks = f" x{cfg.dw_blocks_per_sm}/SM" if cfg.dw_blocks_per_sm > 1 else ""
    return f"drhs {cfg.dw_block_k}x{cfg.dw_block_n} t{cfg.dw_block_t} st{cfg.dw_stages}{blocks}"


def _describe(cfg) -> str:
    kind = f"ws-{cfg.wg_split}{'' if cfg.chained else '-unchained'}" if cfg.warp_specialized else "single"
    walk = f"walk{cfg.grid_block_n}" if cfg.grid_block_n else "walkrow"
    blocks = f" x{cfg.blocks_per_sm}/SM" if cfg.blocks_per_sm > 1 else ""
    return f"{kind} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} st{cfg.stages} {walk}{blocks}"


def _table_variants(table) -> list:
    """The table's config as it is, unchained (when it chains), with the other walk (TileConfig.grid_block_n:
    along a tile's N-blocks, 0, or down the tiles, 1)."""
    out = [table]
    if table.warp_specialized and table.chained:
        out.append(dataclasses.replace(table, chained=False))
    out.append(dataclasses.replace(table, grid_block_n=0 if table.grid_block_n else 1))
    return out


_SWEEP_RANK = 16  # the expert adapters' rank in the training benchmark (scripts.bench's LoRA r)


def _adapter_jobs(shape: GmmShape, direction: str, variants, args, fused_on_gpu: bool) -> list:
    """(row, jitted fn, args) of each (name, config, body) of an adapter's variants: "fused", or "two kernels";
    the table's row is the one a GPU step runs: fused while `fused_on_gpu` (mosaic's FUSED_* flag) and its tiles
    fit, else the two kernels."""
    names = [name for name, _, _ in variants]
    mark = "fused" if fused_on_gpu and "fused" in names else "two kernels"
    return [({"shape": shape.name, "direction": direction, "label": f"{name} {_describe(cfg)}",
              "config": dataclasses.asdict(cfg), "table": name == mark, "work": _work(shape)["fwd"]},
             jax.jit(body), args) for name, cfg, body in variants]


def run_sweep(shapes: Sequence[GmmShape], iters: int = 10, compile_threads: int = 8,
              candidates=None, dw_candidates=sweep_dw_candidates, timing_rounds: int = 5) -> list[dict]:
    """Rows {"shape", "direction": "fwd" | "dlhs" | "fwd+lora" | "dlhs+lora" | "drhs", "label", "config", "table": bool,
    "ms", "tflops"} for the row-tile kernel on the table's config (`_table_variants`: also unchained, and with the
    other walk) and on every `candidates(kc, n)` config (default `sweep_candidates`) of each shape's forward and d
    lhs; the forward with a rank-16 adapter fused ("fwd+lora", `tiles.fused_config`'s tiles) and as a second kernel
    added after; the same for the d lhs with the down adapter's d xa @ a^T ("dlhs+lora",
    `mosaic.unfused_backward_lhs` for the two kernels); and the d rhs (group-tile) kernel on the table's dw_* tiles
    and each of `dw_candidates(k, n)` (None: no d rhs). The programs compile on `compile_threads` threads first
    (Mosaic GPU's compiles are most of the sweep's time), then run one at a time. Every row but the table's also
    gets "max_abs_diff_vs_table": its output against the table row's of the same shape and direction."""
    import concurrent.futures

    from kernels_pallas.grouped_matmul import mosaic, mosaic_drhs, tiles

    candidates = candidates or sweep_candidates
    interpret = jax.default_backend() != "gpu"  # the tests: Mosaic GPU's interpreter
    jobs = []  # (row, jitted fn, args)
    for shape in shapes:
        lhs, rhs, sizes, dout = make_inputs(shape)
        key = (shape.k, shape.n, len(shape.group_sizes))
        fwd_table = tiles.config_for(*key)  # the forward's entry; d rhs reads its dw_* fields
        for direction in ("fwd", "dlhs"):
            table = fwd_table if direction == "fwd" else tiles._dlhs_config(fwd_table, *key)
            kc, width = (shape.k, shape.n) if direction == "fwd" else (shape.n, shape.k)
            configs = _table_variants(table) + two_block_candidates(kc, width) + candidates(kc, width)
            args = (lhs if direction == "fwd" else dout, rhs, sizes)
            for cfg in configs:
                row = {"shape": shape.name, "direction": direction, "label": _describe(cfg),
                       "config": dataclasses.asdict(cfg), "table": cfg is table, "work": _work(shape)["fwd"]}
                fn = jax.jit(lambda a, b, s, cfg=cfg, t=direction == "dlhs": mosaic._rows(cfg)(
                    a, b, s, cfg, transpose_rhs=t, interpret=interpret))
                jobs.append((row, fn, args))
        # The forward with a rank-16 expert adapter: fused into the kernel (`fused_config`'s tiles) against the
        # adapter's product as a second kernel added after (what the GPU runs if mosaic.FUSED_LORA_ON_GPU is off).
        table = fwd_table
        fused = tiles.fused_config(table, shape.k, _SWEEP_RANK)
        xa = jax.random.normal(jax.random.key(1), (shape.m, _SWEEP_RANK), jnp.float32).astype(lhs.dtype)
        b = jax.random.normal(jax.random.key(2), (len(shape.group_sizes), _SWEEP_RANK, shape.n),
                              jnp.float32).astype(lhs.dtype)
        variants = [("fused", fused, lambda a, w, s, x, bb, cfg=fused: mosaic._rows(cfg)(
                        a, w, s, cfg, lora=(x, bb), interpret=interpret))] if fused is not None else []
        variants.append(("two kernels", table, lambda a, w, s, x, bb, cfg=table: mosaic.unfused_forward(
            a, w, s, cfg, (x, bb), interpret=interpret)))
        jobs += _adapter_jobs(shape, "fwd+lora", variants, (lhs, rhs, sizes, xa, b), mosaic.FUSED_LORA_ON_GPU)
        # The d lhs with the down adapter's d xa @ a^T (`backward_lhs(adapter=)`): fused into the transposed row
        # kernel against a's own d lhs kernel added after (the GPU's path if mosaic.FUSED_DLHS_LORA_ON_GPU is off).
        table = tiles._dlhs_config(fwd_table, *key)
        fused = tiles.fused_config(table, shape.n, _SWEEP_RANK)
        a = jax.random.normal(jax.random.key(3), (len(shape.group_sizes), shape.k, _SWEEP_RANK),
                              jnp.float32).astype(lhs.dtype)
        variants = [("fused", fused, lambda d, w, s, x, aa, cfg=fused: mosaic._rows(cfg)(
                        d, w, s, cfg, transpose_rhs=True, lora=(x, jnp.swapaxes(aa, 1, 2)), interpret=interpret))
                    ] if fused is not None else []
        variants.append(("two kernels", table, lambda d, w, s, x, aa, key=key: mosaic.unfused_backward_lhs(
            w, s, d, key, (x, aa), interpret=interpret)))
        jobs += _adapter_jobs(shape, "dlhs+lora", variants, (dout, rhs, sizes, xa, a),
                              mosaic.FUSED_DLHS_LORA_ON_GPU)
        if dw_candidates is None:
            continue
        # d rhs runs on the forward entry's dw_* tiles (not the d lhs entry's, which `table` now names).
        for cfg in [fwd_table, *multi_block_dw_candidates(shape.k, shape.n),
                    *dw_candidates(shape.k, shape.n)]:
            row = {"shape": shape.name, "direction": "drhs", "label": _describe_dw(cfg),
                   "config": dataclasses.asdict(cfg), "table": cfg is fwd_table, "work": _work(shape)["fwd"]}
            fn = jax.jit(lambda a, d, s, cfg=cfg: mosaic_drhs.gmm_drhs(a, d, s, cfg, interpret=interpret))
            jobs.append((row, fn, (lhs, dout, sizes)))

    def build(job):
        row, fn, args = job
        try:
            return fn.lower(*args).compile()
        except Exception as e:  # noqa: BLE001 - a config that does not compile must not lose the others
            row["error"] = f"{type(e).__name__}: {e}"[:500]
            return None

    with concurrent.futures.ThreadPoolExecutor(compile_threads) as pool:
        compiled = list(pool.map(build, jobs))
    rows = []
    # Each variant's output against its table row's (same shape and direction), so a faster variant is also shown
    # to compute the same product on the GPU: the table's rows come first for fwd / dlhs / drhs; the adapter rows'
    # table may come second, so those are compared once both ran.
    outputs: dict[tuple[str, str], list] = {}
    for (row, _, args), program in zip(jobs, compiled):
        if program is not None:
            try:
                ms = queued_ms(program, args, iters, timing_rounds)
                row.update(ms=ms, tflops=row["work"] / (ms * 1e-3) / 1e12)
                outputs.setdefault((row["shape"], row["direction"]), []).append((row, program(*args)))
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:500]
        mark = "*" if row["table"] else " "
        result = f"{row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s" if "ms" in row else f"ERROR {row['error'][:200]}"
        print(f"{row['shape']:<24} {row['direction']:<8} {row['label']:<46} {mark} {result}", flush=True)
        rows.append(row)
    for group in outputs.values():
        table = next((out for row, out in group if row["table"]), None)
        for row, out in group:
            if table is not None and not row["table"]:
                row["max_abs_diff_vs_table"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) -
                                                                     table.astype(jnp.float32))))
                print(f"{row['shape']:<24} {row['direction']:<8} {row['label']:<46}   max |out - table's out| "
                      f"{row['max_abs_diff_vs_table']:.3g}", flush=True)
    return rows


def probe_problems(shape: GmmShape) -> list[tuple[str, GmmShape]]:
    """Problems derived from `shape` that take its row kernel's time apart (`run_probe`): as it is; the same rows in
    equal groups (no group's last tile partial where m / G is a multiple of the tile); one group of all the rows (a
    dense product through the grouped kernel); the same rows in G / 4 and G / 16 equal groups (where G allows: the
    same units over fewer expert matrices, so the time against the experts' bytes); equal groups with the
    contraction 2x and 4x as long (the same units, more steps each: the time per unit against the steps, whose
    intercept is what a unit costs besides its products)."""
    g = len(shape.group_sizes)
    even = (shape.m // g,) * g
    derived = lambda label, **kw: (label, dataclasses.replace(shape, name=f"{shape.name} {label}", **kw))
    fewer = [derived(f"{g // d} equal groups", group_sizes=(shape.m // (g // d),) * (g // d))
             for d in (4, 16) if g // d > 1 and g % d == 0]
    return [("as is", shape), derived("equal groups", group_sizes=even), *fewer,
            derived("one group", group_sizes=(shape.m,)), derived("equal groups, K x2", group_sizes=even, k=2 * shape.k),
            derived("equal groups, K x4", group_sizes=even, k=4 * shape.k)]


def _spot_check(out, lhs, rhs, group_sizes) -> float:
    """max |out - lhs_g @ rhs[g]| over the rows of the first, middle and last groups, in float32. (A whole reference
    of the full shapes is a one-hot product on the GPU, XLA's ragged dot included: [M, G N] floats, 48 GiB at
    Qwen3-30B-A3B gate_up with K x4.)"""
    ends = [sum(group_sizes[:i + 1]) for i in range(len(group_sizes))]
    worst = 0.0
    for g in sorted({0, len(group_sizes) // 2, len(group_sizes) - 1}):
        rows = slice(ends[g] - group_sizes[g], ends[g])
        want = lhs[rows].astype(jnp.float32) @ rhs[g].astype(jnp.float32)
        worst = max(worst, float(jnp.max(jnp.abs(out[rows].astype(jnp.float32) - want), initial=0.0)))
    return worst


# JAX's own dense Mosaic GPU matmul (jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu) at tiles near the table's
# Qwen3-30B-A3B down entry: (tile_m, tile_n, stages, warpgroups split along, cluster of two along). Its CTA tile is
# 128 x 256 with the warpgroups along N (like ours) or 256 x 128 along M; its clusters multicast the tile shared along
# the other dimension.
_JAX_DENSE = ((128, 128, 3, "N", None), (128, 128, 3, "N", "M"), (128, 128, 3, "N", "N"), (128, 128, 3, "M", None),
              (128, 128, 3, "M", "N"))


def _jax_dense_programs(lhs, rhs) -> dict:
    """The probe's rows of `_JAX_DENSE` on one group ([M, K] @ [K, N]; on a GPU only: the example takes no
    interpreter): {impl: (None, label, program, args, True)}, as `run_probe` keeps its programs. Why: the one-group
    problem is a dense product, so this says how far the Pallas warp-specialised structure itself gets on it, beside
    cuBLAS (XLA) and the grouped kernel."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    dim, out = hm.MatmulDimension, {}
    for tm, tn, st, wg, cluster in _JAX_DENSE:
        cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=st, wg_dimension=dim[wg],
                              cluster_dimension=dim[cluster] if cluster else None)
        label = f"jax example {tm}x{tn}x64 st{st} wg-{wg}" + (f" cluster-{cluster}" if cluster else "")
        out[label] = (None, label, jax.jit(functools.partial(hm.matmul, c=None, config=cfg)), (lhs, rhs), True)
    return out


def run_probe(shapes: Sequence[GmmShape], iters: int = 10, timing_rounds: int = 5,
              variants: Sequence[dict] = ()) -> list[dict]:
    """Rows {"shape", "problem", "impl": "mosaic" | "mosaic variant N" | "mosaic rhs [G, N, K]" | "dense", "config",
    "ms", "tflops", ...} for each of `probe_problems`: the forward row kernel on the tiles of the *original* shape's
    table entry (so every problem runs the same kernel), the same with each of `variants` ({TileConfig field: value}
    applied to the entry: `--probe-variant`), the table's kernel reading the experts stored transposed ([G, N, K], as
    nn.Linear stores a weight: each expert tile [cta_n, K] one contiguous block, where [G, K, N] spreads it over K
    rows N elements apart), and a dense XLA matmul of the same rows; on a GPU the one-group problem also runs JAX's
    own dense Mosaic GPU matmul (`_JAX_DENSE`, impl "jax example ..."). Mosaic rows also give "units" (the (row tile,
    N-block) pairs the SMs walk), "k_steps", "us_per_unit" (ms x SMs / units: one unit's time on one SM) and
    "max_abs_diff" (its output on the first, middle and last groups' rows against `_spot_check`'s float32
    products)."""
    from kernels_pallas.grouped_matmul import mosaic, tiles
    from kernels_pallas.grouped_matmul.mosaic_kernels import _num_sms, row_tiles

    interpret = jax.default_backend() != "gpu"  # the tests: Mosaic GPU's interpreter
    rows = []
    for shape in shapes:
        table = tiles.config_for(shape.k, shape.n, len(shape.group_sizes))
        kernels = {"mosaic": table} | {f"mosaic variant {i + 1}": dataclasses.replace(table, **v)
                                       for i, v in enumerate(variants)}
        for label, problem in probe_problems(shape):
            lhs, rhs, sizes, _ = make_inputs(problem)
            used = sum(problem.group_sizes)
            work = _work(problem)["fwd"]
            base = {"shape": shape.name, "problem": label, "m": problem.m, "k": problem.k, "n": problem.n,
                    "groups": len(problem.group_sizes)}
            # impl: (tiles or None, the row's config label, program, its arguments, whether its output is the
            # grouped product of all rows, so `_spot_check` applies: not the dense XLA matmul of every row by rhs[0])
            programs = {name: (cfg, _describe(cfg), jax.jit(lambda a, b, s, cfg=cfg: mosaic._rows(cfg)(
                a, b, s, cfg, interpret=interpret)), (lhs, rhs, sizes), True) for name, cfg in kernels.items()}
            programs["mosaic rhs [G, N, K]"] = (table, _describe(table) + " rhs^T", jax.jit(
                lambda a, bt, s: mosaic._rows(table)(a, bt, s, table, transpose_rhs=True, interpret=interpret)),
                (lhs, jnp.swapaxes(rhs, 1, 2), sizes), True)
            programs["dense"] = (None, "xla", jax.jit(lambda a, b: a @ b[0]), (lhs[:used], rhs), False)
            if label == "one group" and not interpret:
                programs |= _jax_dense_programs(lhs, rhs[0])
            for impl, (cfg, config, fn, args, grouped) in programs.items():
                row = {**base, "impl": impl, "config": config}
                try:
                    compiled = fn.lower(*args).compile()
                    ms = queued_ms(compiled, args, iters, timing_rounds)
                    row.update(ms=ms, tflops=work / (ms * 1e-3) / 1e12)
                    if grouped:
                        row["max_abs_diff"] = _spot_check(compiled(*args), lhs, rhs, problem.group_sizes)
                    if cfg is not None:
                        group = row_tiles(sizes, -(-problem.m // cfg.block_m) * cfg.block_m, cfg.block_m)[0]
                        units = int(jnp.sum(group <= len(problem.group_sizes))) * -(-problem.n // cfg.cta_n)
                        row.update(units=units, k_steps=problem.k // cfg.block_k,
                                   us_per_unit=ms * 1e3 * _num_sms(interpret) / units)
                except Exception as e:  # noqa: BLE001 - one failure must not lose the other rows
                    row["error"] = f"{type(e).__name__}: {e}"[:500]
                extra = f" {row['units']} units x {row['k_steps']} steps, {row['us_per_unit']:.3f} us a unit, " \
                    f"max |diff| {row['max_abs_diff']:.3g}" if "units" in row else ""
                result = f"{row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s{extra}" if "ms" in row else \
                    f"ERROR {row['error'][:200]}"
                print(f"{shape.name:<24} {label:<20} {row['config']:<40} {result}", flush=True)
                rows.append(row)
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
    ap.add_argument("--iters", type=int, default=10, help="calls queued back to back per timing")
    ap.add_argument("--timing-rounds", type=int, default=5, help="timings per program; the median is reported")
    ap.add_argument("--json", default=None, help="write the rows here as JSON")
    ap.add_argument("--against", default=None, help="another tree's root: A/B of the Mosaic GPU kernels")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds of the --against A/B")
    ap.add_argument("--sweep", action="store_true", help="the row kernels on every candidate tile config")
    ap.add_argument("--probe", action="store_true",
                    help="the forward row kernel on problems derived from each shape (equal groups, one group, "
                         "K x2 / x4), beside dense XLA: where its time goes")
    ap.add_argument("--probe-variant", action="append", default=[], metavar="FIELD=VALUE[,FIELD=VALUE]",
                    help="with --probe: also the table's entry with these TileConfig fields, e.g. stages=4 "
                         "(repeatable)")
    ap.add_argument("--table-variants", action="store_true",
                    help="with --sweep: only the table's configs and their variants (no candidates, no d rhs)")
    args = ap.parse_args(argv)
    if args.table_variants and not args.sweep:
        ap.error("--table-variants narrows --sweep; add --sweep")
    if args.probe_variant and not args.probe:
        ap.error("--probe-variant adds kernels to --probe; add --probe")
    for flag in ("rounds", "iters", "timing_rounds"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
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
    if args.sweep:
        # A shape at a time, the JSON rewritten after each: a sweep cut by its call's time limit keeps what it timed.
        rows = []
        # (dw_candidates None: no d rhs rows at all, as the flag's help says; an empty list still timed the table's
        # d rhs and its several-blocks candidates, which may be what ran section 48's sweep past its time limit)
        narrow = dict(candidates=lambda kc, n: [], dw_candidates=None) if args.table_variants else {}
        for shape in [s for s in shapes if jnp.dtype(s.dtype) == jnp.bfloat16]:
            rows += run_sweep([shape], args.iters, timing_rounds=args.timing_rounds, **narrow)
            _write(args.json, rows)
    elif args.probe:
        variants = [_tile_fields(ap, text) for text in args.probe_variant]
        rows = run_probe([s for s in shapes if jnp.dtype(s.dtype) == jnp.bfloat16], args.iters, args.timing_rounds,
                         variants)
    elif args.against:
        shapes = [s for s in shapes if jnp.dtype(s.dtype) == jnp.bfloat16]  # the kernels' dtypes on the GPU
        rows = run_against(shapes, load_kernels(args.against), args.rounds, args.iters)
    else:
        rows = run(shapes, impls, args.iters, args.timing_rounds)
    _write(args.json, rows)
    return rows


def _tile_fields(ap: argparse.ArgumentParser, text: str) -> dict:
    """{field: value} of a `--probe-variant` (FIELD=VALUE[,FIELD=VALUE]), each value typed as its TileConfig field."""
    from kernels_pallas.grouped_matmul.tiles import TileConfig

    types = {f.name: f.type for f in dataclasses.fields(TileConfig)}
    out = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name not in types or not value:
            ap.error(f"--probe-variant {item!r}: expected FIELD=VALUE with FIELD one of {sorted(types)}")
        try:
            out[name] = {"int": int, "bool": lambda v: bool(int(v)), "str": str}[types[name]](value)
        except ValueError:
            ap.error(f"--probe-variant {item!r}: {name} is a TileConfig {types[name]}")
    return out


def _write(path: str | None, rows: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"devices": [str(d) for d in jax.devices()], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
