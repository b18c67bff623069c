"""Benchmark / test shape list shared by scripts/bench_attention.py and the tests.

Benchmark shapes (issue spec): bf16, 16k tokens per batch (B = max(1, 16384 // T)),
H=32, KV=8, D=128: dense causal T = 2k, 8k, 32k; packed (lognormal documents,
mean length 300) T = 8k, 32k; causal sliding window 4096 at T = 32k.
``TEST_SHAPES`` are the same layouts scaled down for Pallas interpret mode.
"""

from __future__ import annotations

import dataclasses

import numpy as np

_WHERE = "kernels_pallas/attention/bench.py"
LAYOUTS = ("dense", "packed", "window")


@dataclasses.dataclass(frozen=True)
class AttnShape:
    name: str
    batch: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    layout: str  # "dense" | "packed" | "window"
    mean_doc_len: int | None = None
    window: int | None = None

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"{_WHERE}: AttnShape.layout={self.layout!r}; use one of {LAYOUTS}.")
        if self.heads % self.kv_heads:
            raise ValueError(f"{_WHERE}: heads={self.heads} not a multiple of kv_heads={self.kv_heads}.")
        if self.layout == "packed" and not self.mean_doc_len:
            raise ValueError(f"{_WHERE}: packed shape {self.name} needs mean_doc_len.")
        if self.layout == "window" and not self.window:
            raise ValueError(f"{_WHERE}: window shape {self.name} needs window.")


def _bench(name, t, layout, **kw) -> AttnShape:
    return AttnShape(name, max(1, 16384 // t), t, 32, 8, 128, layout, **kw)


BENCH_SHAPES: tuple[AttnShape, ...] = (
    _bench("dense_2k", 2048, "dense"),
    _bench("dense_8k", 8192, "dense"),
    _bench("dense_32k", 32768, "dense"),
    _bench("packed_8k", 8192, "packed", mean_doc_len=300),
    _bench("packed_32k", 32768, "packed", mean_doc_len=300),
    _bench("window4k_32k", 32768, "window", window=4096),
)

# Same layouts, interpret-mode sized (T=256, metadata block 64).
TEST_SHAPES: tuple[AttnShape, ...] = (
    AttnShape("t_dense", 1, 256, 4, 2, 64, "dense"),
    AttnShape("t_packed", 2, 256, 4, 1, 64, "packed", mean_doc_len=40),
    AttnShape("t_window", 1, 256, 4, 2, 64, "window", window=80),
)


def make_segment_ids(shape: AttnShape, seed: int = 0, pad_tail: int = 0) -> np.ndarray:
    """[B, T] int32 segment ids for a shape.

    dense/window: all ones.  packed: documents with lognormal lengths
    (sigma = 1, mean = mean_doc_len, at least 1 token) packed greedily; the last
    document of a row is cut at the row end; ids restart at 1 per row.
    ``pad_tail`` > 0 leaves up to that many trailing padding tokens (id 0).
    """
    b, t = shape.batch, shape.seq_len
    if shape.layout != "packed":
        seg = np.ones((b, t), np.int32)
    else:
        rng = np.random.default_rng(seed)
        sigma = 1.0
        mu = np.log(shape.mean_doc_len) - sigma**2 / 2
        seg = np.zeros((b, t), np.int32)
        for r in range(b):
            pos, doc = 0, 1
            while pos < t:
                n = max(1, int(round(rng.lognormal(mu, sigma))))
                seg[r, pos:pos + n] = doc
                pos += n
                doc += 1
    if pad_tail:
        seg[:, t - pad_tail:] = 0
    return seg


def kept_pairs(segment_ids: np.ndarray, causal: bool = True, window: int | None = None) -> int:
    """Number of (query, key) pairs the mask keeps (assumes contiguous segments)."""
    total = 0
    for row in np.asarray(segment_ids):
        change = np.flatnonzero(np.diff(row)) + 1
        bounds = np.concatenate([[0], change, [len(row)]])
        for length in np.diff(bounds):
            i = np.arange(length, dtype=np.int64)
            vis = i + 1 if causal else np.full_like(i, length)
            if window is not None:
                vis = np.minimum(vis, window) if causal else length - np.maximum(0, i - window + 1)
            total += int(vis.sum())
    return total


def useful_flops(shape: AttnShape, segment_ids: np.ndarray) -> tuple[float, float]:
    """(forward, forward+backward) FLOPs counting only kept score entries.

    Forward: 2 matmuls (QK^T, PV) = 4 * D flops per kept pair per head.
    Backward: 5 matmuls (QK^T recompute, dV, dP, dQ, dK) = 10 * D.
    """
    pairs = kept_pairs(segment_ids, causal=True, window=shape.window)
    fwd = 4.0 * shape.head_dim * shape.heads * pairs
    return fwd, fwd * 3.5
