"""Attention problem shapes shared by the tests and the lab's benchmark (experiments/probes/bench_attention.py).

Benchmark shapes (issue spec): bf16, 16k tokens per batch (B = max(1, 16384 // T)),
H=32, KV=8, D=128: dense causal T = 2k, 8k, 32k; packed (lognormal documents,
mean length 300) T = 8k, 32k; causal sliding window 4096 at T = 32k.
``TEST_SHAPES`` are the same layouts scaled down for Pallas interpret mode;
``GPU_TEST_SHAPES`` are small enough that the GPU tests compile and run in seconds.
"""

from __future__ import annotations

import dataclasses

import numpy as np

_WHERE = "kernels_pallas/attention/shapes.py"
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

# On the device: one shape per layout, bf16 in the tests, T = 512 (4 x 128 metadata blocks).
GPU_TEST_SHAPES: tuple[AttnShape, ...] = (
    AttnShape("g_dense", 2, 512, 8, 2, 128, "dense"),
    AttnShape("g_packed", 2, 512, 8, 2, 128, "packed", mean_doc_len=60),
    AttnShape("g_window", 2, 512, 8, 2, 128, "window", window=200),
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
