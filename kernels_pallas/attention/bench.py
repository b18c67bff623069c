"""Benchmark helpers for experiments/probes/bench_attention.py: FLOP counts of the attention shapes.

The shapes themselves (``BENCH_SHAPES``, ``TEST_SHAPES``, ``make_segment_ids``) live in shapes.py, which the
tests and the benchmark script import.
"""

from __future__ import annotations

import numpy as np

from kernels_pallas.attention.metadata import kept_pairs
from kernels_pallas.attention.shapes import AttnShape


def useful_flops(shape: AttnShape, segment_ids: np.ndarray) -> tuple[float, float]:
    """(forward, forward+backward) FLOPs counting only kept score entries.

    Forward: 2 matmuls (QK^T, PV) = 4 * D flops per kept pair per head.
    Backward: 5 matmuls (QK^T recompute, dV, dP, dQ, dK) = 10 * D.
    """
    pairs = kept_pairs(segment_ids, window=shape.window)
    fwd = 4.0 * shape.head_dim * shape.heads * pairs
    return fwd, fwd * 3.5
