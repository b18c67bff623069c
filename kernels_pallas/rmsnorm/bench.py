"""Benchmark: every implementation of the rmsnorm op (OP in api.py), forward+backward, on shapes.BENCH_SHAPES.

    python -m kernels_pallas.rmsnorm.bench            # BENCH_SHAPES (GPU-sized)
    python -m kernels_pallas.rmsnorm.bench --smoke    # shapes.TEST_SHAPES[0], CPU ok
"""

from __future__ import annotations

from collections.abc import Sequence

from kernels_pallas._bench import Timing, bench_main, time_fwd_bwd

from .api import OP
from .shapes import BENCH_SHAPES, TEST_SHAPES, make_inputs

EPS = 1e-6


def run(shapes=BENCH_SHAPES, implementations: Sequence[str] = OP.names, iters: int = 10) -> list[Timing]:
    rows = []
    for shape in shapes:
        x, weight, _ = make_inputs(shape)
        for name in implementations:
            fn = OP.resolve(name).fn
            rows.append(time_fwd_bwd("rmsnorm", shape.name, name, lambda x, w, fn=fn: fn(x, w, EPS),
                                     (x, weight), iters=iters))
    return rows


def main(argv: Sequence[str] | None = None) -> list[Timing]:
    return bench_main(__doc__, run, TEST_SHAPES, BENCH_SHAPES, argv)


if __name__ == "__main__":
    main()
