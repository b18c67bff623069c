"""Benchmark: every implementation of the glu op (OP in api.py), forward+backward, on shapes.BENCH_SHAPES.

    python -m kernels_pallas.glu.bench            # BENCH_SHAPES (GPU-sized)
    python -m kernels_pallas.glu.bench --smoke    # shapes.TEST_SHAPES[0], CPU ok
"""

from __future__ import annotations

from collections.abc import Sequence

from kernels_pallas._bench import Timing, bench_main, time_fwd_bwd

from .api import OP
from .shapes import BENCH_SHAPES, TEST_SHAPES, make_inputs



def run(shapes=BENCH_SHAPES, implementations: Sequence[str] = OP.names, iters: int = 10) -> list[Timing]:
    rows = []
    for shape in shapes:
        gate, up, _ = make_inputs(shape)
        for name in implementations:
            rows.append(time_fwd_bwd("swiglu", shape.name, name, OP.resolve(name).fn, (gate, up), iters=iters))
    return rows


def main(argv: Sequence[str] | None = None) -> list[Timing]:
    return bench_main(__doc__, run, TEST_SHAPES, BENCH_SHAPES, argv)


if __name__ == "__main__":
    main()
