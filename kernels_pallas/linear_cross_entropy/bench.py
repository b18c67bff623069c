"""Benchmark: chunked ``xla`` linear cross-entropy vs the naive reference.

Times the jitted loss (forward only, or value-and-grad) per implementation and
reports the compiled temporary memory (``memory_analysis().temp_size_in_bytes``)
next to the size of the full fp32 logits it avoids.  Meant for the GPU
(``scripts/gpu_check.sh``)::

    python -m kernels_pallas.linear_cross_entropy.bench            # SHAPES
    python -m kernels_pallas.linear_cross_entropy.bench --smoke    # tiny, CPU ok
    python -m kernels_pallas.linear_cross_entropy.bench --chunk-sweep 256,512,1024

Inputs are generated on the device inside a jit (no host transfer of the
``[H, V]`` head); ``weight`` is scaled by ``H**-0.5`` so logits are O(1).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from .api import OP, linear_cross_entropy
from .config import tiles_for
from .shapes import SHAPES, SMOKE_SHAPE, BenchShape

MODES = ("forward", "grad_hidden", "grad_hidden_weight")


@dataclasses.dataclass(frozen=True)
class BenchResult:
    shape: str
    implementation: str
    mode: str
    chunk_size: int | None
    milliseconds: float
    temp_bytes: int | None
    full_logits_bytes: int
    loss: float


def make_inputs(shape: BenchShape, seed: int = 0):
    """Random ``(hidden, weight, targets, weights)`` created on the device."""

    @jax.jit
    def make(key):
        kh, kw, kt, km = jax.random.split(key, 4)
        dtype = jnp.dtype(shape.dtype)
        hidden = jax.random.normal(kh, (shape.num_tokens, shape.hidden), dtype)
        weight = (
            jax.random.normal(kw, (shape.hidden, shape.vocab), jnp.float32)
            * shape.hidden**-0.5
        ).astype(dtype)
        targets = jax.random.randint(kt, (shape.num_tokens,), 0, shape.vocab, jnp.int32)
        # ~10% ignored tokens, as in packed SFT batches.
        weights = (jax.random.uniform(km, (shape.num_tokens,)) > 0.1).astype(jnp.float32)
        return hidden, weight, targets, weights

    return make(jax.random.key(seed))


def _loss_fn(shape: BenchShape, implementation: str, mode: str, chunk_size: int | None):
    def loss(hidden, weight, targets, weights):
        return linear_cross_entropy(
            hidden, weight, targets, weights,
            logit_softcap=shape.logit_softcap,
            chunk_size=chunk_size,
            implementation=implementation,
        )

    if mode == "forward":
        return jax.jit(loss)
    argnums = (0,) if mode == "grad_hidden" else (0, 1)
    grad = jax.value_and_grad(loss, argnums=argnums)
    return jax.jit(grad)


def run_one(
    shape: BenchShape,
    implementation: str,
    *,
    mode: str = "grad_hidden",
    chunk_size: int | None = None,
    iters: int = 10,
    warmup: int = 2,
    inputs=None,
    compiler_options: dict | None = None,
) -> BenchResult:
    """Compiles, warms up and times one configuration (median of ``iters``).

    ``compiler_options`` go to ``.compile()`` (the GPU test turns XLA's GEMM autotuning off there)."""
    OP.canonical(implementation)  # one-line error naming the choices
    if mode not in MODES:
        raise ValueError(f"bench.py: mode must be one of {MODES}, got {mode!r}.")
    if iters < 1 or warmup < 0:
        raise ValueError(f"bench.py: need iters >= 1 and warmup >= 0, got {iters}, {warmup}.")
    args = make_inputs(shape) if inputs is None else inputs
    fn = _loss_fn(shape, implementation, mode, chunk_size)
    compiled = fn.lower(*args).compile(compiler_options=compiler_options or {})
    analysis = compiled.memory_analysis()
    temp = None if analysis is None else int(analysis.temp_size_in_bytes)
    out = None
    for _ in range(warmup):
        out = jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    times.sort()
    loss = out if mode == "forward" else out[0]
    used_chunk = (
        None if implementation == "reference"
        else chunk_size or tiles_for(jax.devices()[0].device_kind, shape.num_tokens, shape.vocab)
    )
    return BenchResult(
        shape=shape.name,
        implementation=implementation,
        mode=mode,
        chunk_size=used_chunk,
        milliseconds=1e3 * times[len(times) // 2],
        temp_bytes=temp,
        full_logits_bytes=shape.full_logits_bytes,
        loss=float(loss),
    )


def compare(
    shapes: Sequence[BenchShape] = SHAPES,
    *,
    modes: Sequence[str] = ("forward", "grad_hidden"),
    implementations: Sequence[str] = ("xla", "reference"),
    chunk_sizes: Sequence[int | None] = (None,),
    iters: int = 10,
    warmup: int = 2,
    compiler_options: dict | None = None,
) -> list[BenchResult]:
    """Times every (shape, mode, implementation[, chunk size]) combination.

    Chunk sizes only apply to ``xla``; the reference runs once per mode.  A
    configuration that fails (e.g. the reference running out of memory) is
    reported on stdout and skipped rather than aborting the sweep.
    """
    results = []
    for shape in shapes:
        inputs = make_inputs(shape)
        for mode in modes:
            for impl in implementations:
                sizes = chunk_sizes if impl == "xla" else (None,)
                for size in sizes:
                    try:
                        results.append(
                            run_one(shape, impl, mode=mode, chunk_size=size,
                                    iters=iters, warmup=warmup, inputs=inputs,
                                    compiler_options=compiler_options)
                        )
                    except Exception as err:  # noqa: BLE001 - keep sweeping
                        print(f"[bench] {shape.name} {mode} {impl} chunk={size}: "
                              f"FAILED {type(err).__name__}: {str(err)[:200]}")
        del inputs
    return results


def format_results(results: Sequence[BenchResult]) -> str:
    lines = [
        f"{'shape':<20} {'mode':<19} {'impl':<10} {'chunk':>6} {'ms':>9} "
        f"{'temp MiB':>9} {'logits MiB':>10} {'loss':>14}"
    ]
    for r in results:
        temp = "n/a" if r.temp_bytes is None else f"{r.temp_bytes / 2**20:.0f}"
        lines.append(
            f"{r.shape:<20} {r.mode:<19} {r.implementation:<10} "
            f"{r.chunk_size if r.chunk_size is not None else '-':>6} "
            f"{r.milliseconds:>9.2f} {temp:>9} {r.full_logits_bytes / 2**20:>10.0f} "
            f"{r.loss:>14.6g}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[BenchResult]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shape (CPU ok)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--modes", default="forward,grad_hidden",
                        help=f"comma list from {MODES}")
    parser.add_argument("--implementations", default="xla,reference")
    parser.add_argument("--chunk-sweep", default="",
                        help="comma list of xla chunk sizes (default: config)")
    args = parser.parse_args(argv)
    shapes = (SMOKE_SHAPE,) if args.smoke else SHAPES
    sizes = tuple(int(s) for s in args.chunk_sweep.split(",") if s) or (None,)
    results = compare(
        shapes,
        modes=tuple(m for m in args.modes.split(",") if m),
        implementations=tuple(i for i in args.implementations.split(",") if i),
        chunk_sizes=sizes,
        iters=args.iters,
    )
    print(f"devices: {jax.devices()}")
    print(format_results(results))
    return results


if __name__ == "__main__":
    main()
