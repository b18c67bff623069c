"""Timing helpers shared by the ops' benchmarks (rmsnorm/bench.py, glu/bench.py, ...).

Each benchmark times, per implementation of the op's registry, the jitted forward+backward
(``jax.vjp`` then the pullback) on the op's shared shapes and reports the compiled temporary memory,
so the custom VJP's saving of residuals shows next to its speed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax


@dataclasses.dataclass(frozen=True)
class Timing:
    op: str
    shape: str
    implementation: str
    milliseconds: float
    temp_bytes: int | None


def time_fwd_bwd(op: str, shape: str, implementation: str, fn: Callable, args: Sequence[jax.Array],
                 *, iters: int = 10, warmup: int = 2, frozen: Sequence[jax.Array] = ()) -> Timing:
    """Median wall time of ``vjp(fn, *args)`` and its pullback on ones, compiled once. ``frozen`` arrays are
    passed to ``fn`` after ``args`` as jit arguments that are not differentiated (a frozen weight): closing
    over them instead would make them constants, which XLA may fold (e.g. a whole dequantisation) at compile."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"kernels_pallas/_bench.py: need iters >= 1 and warmup >= 0, got {iters}, {warmup}.")
    n = len(args)

    def step(*a):
        out, pullback = jax.vjp(lambda *d: fn(*d, *a[n:]), *a[:n])
        return out, pullback(jax.numpy.ones_like(out))

    args = (*args, *frozen)
    compiled = jax.jit(step).lower(*args).compile()
    analysis = compiled.memory_analysis()
    temp = None if analysis is None else int(analysis.temp_size_in_bytes)
    return Timing(op, shape, implementation, median_ms(compiled, args, iters, warmup), temp)


def median_ms(compiled: Callable, args: Sequence[jax.Array], iters: int, warmup: int = 2) -> float:
    """Median wall time in ms of ``compiled(*args)`` over ``iters`` calls after ``warmup`` ones, each call
    synchronised (block_until_ready) before the clock is read."""
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def format_timings(rows: Sequence[Timing]) -> str:
    lines = [f"{'op':<10} {'shape':<16} {'impl':<10} {'fwd+bwd ms':>11} {'temp MiB':>9}"]
    for r in rows:
        temp = "n/a" if r.temp_bytes is None else f"{r.temp_bytes / 2**20:.1f}"
        lines.append(f"{r.op:<10} {r.shape:<16} {r.implementation:<10} {r.milliseconds:>11.3f} {temp:>9}")
    return "\n".join(lines)


def bench_main(description: str, run: Callable[..., list[Timing]], smoke_shapes, bench_shapes,
               argv: Sequence[str] | None = None) -> list[Timing]:
    """The command line of an elementwise op's bench: `--smoke` (one test shape, CPU ok) and `--iters`."""
    import argparse

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    rows = run(smoke_shapes[:1] if args.smoke else bench_shapes, iters=args.iters)
    print(f"devices: {jax.devices()}")
    print(format_timings(rows))
    return rows
