"""Benchmark: every implementation of the fp8_matmul op (OP in api.py) that runs here, forward + input
gradient, on the 8B projection shapes at training sizes, next to the same matmul on a dense bf16 weight
("dense_bf16").

    python -m kernels_pallas.fp8_matmul.bench            # BENCH_SHAPES (GPU-sized)
    python -m kernels_pallas.fp8_matmul.bench --smoke    # shapes.TEST_SHAPES[0], CPU ok

The weight is quantised once per shape and passed to the timed program as a frozen (not differentiated)
argument: only x is differentiated (a closed-over weight would be a constant XLA folds).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp

from kernels_pallas._bench import Timing, bench_main, time_fwd_bwd

from .api import OP
from .reference import quantize_rows
from .shapes import BENCH_SHAPES, TEST_SHAPES, make_inputs


def run(shapes=BENCH_SHAPES, implementations: Sequence[str] = OP.names, iters: int = 10) -> list[Timing]:
    rows = []
    for shape in shapes:
        x, w, _ = make_inputs(shape)
        q, scale = quantize_rows(w)
        dense = w.astype(x.dtype)
        rows.append(time_fwd_bwd("fp8_matmul", shape.name, "dense_bf16",
                                 lambda a, d: jnp.einsum("mi,oi->mo", a, d), (x,), iters=iters, frozen=(dense,)))
        for name in implementations:
            impl = OP.get(name)
            if not impl.runs_on():
                continue
            rows.append(time_fwd_bwd("fp8_matmul", shape.name, name, lambda a, qq, s, f=impl.fn: f(a, qq, s), (x,),
                                     iters=iters, frozen=(q, scale)))
    return rows


def main(argv: Sequence[str] | None = None) -> list[Timing]:
    return bench_main(__doc__, run, TEST_SHAPES, BENCH_SHAPES, argv)


if __name__ == "__main__":
    main()
