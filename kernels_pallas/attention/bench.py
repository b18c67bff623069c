"""Benchmark helpers shared by scripts/bench_attention.py: FLOP counts of the attention shapes.

The shapes themselves (``BENCH_SHAPES``, ``TEST_SHAPES``, ``make_segment_ids``) live in shapes.py, which
the tests import too; they are re-exported here for the benchmark script.
"""

from __future__ import annotations

import numpy as np

from kernels_pallas.attention.metadata import kept_pairs
from kernels_pallas.attention.shapes import (  # noqa: F401 - re-exported for the benchmark
    BENCH_SHAPES,
    GPU_TEST_SHAPES,
    LAYOUTS,
    TEST_SHAPES,
    AttnShape,
    make_segment_ids,
)


def useful_flops(shape: AttnShape, segment_ids: np.ndarray) -> tuple[float, float]:
    """(forward, forward+backward) FLOPs counting only kept score entries.

    Forward: 2 matmuls (QK^T, PV) = 4 * D flops per kept pair per head.
    Backward: 5 matmuls (QK^T recompute, dV, dP, dQ, dK) = 10 * D.
    """
    pairs = kept_pairs(segment_ids, window=shape.window)
    fwd = 4.0 * shape.head_dim * shape.heads * pairs
    return fwd, fwd * 3.5
