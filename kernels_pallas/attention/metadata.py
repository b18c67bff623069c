"""Per-batch block-sparsity metadata for the flash-attention kernels.

Computed once per packed batch (outside the layer loop) from ``segment_ids``,
``causal`` and ``sliding_window`` only; every layer reuses it.

The padded sequence (length Tp, a multiple of both block sizes) is tiled into
q-blocks i (rows [i*bq, (i+1)*bq)) and kv-blocks j (cols [j*bk, (j+1)*bk)).
For each pair the keep-mask of ``reference.attention_mask`` is summarised as

    block_kind[b, i, j] = 0  EMPTY    no (q, k) pair kept      -> kernels skip it
                          1  PARTIAL  some pairs kept          -> kernels apply the mask
                          2  FULL     every pair kept          -> kernels skip masking

EMPTY and FULL are only claimed when they are certain; an uncertain pair is
PARTIAL (always correct, merely slower).  Segment overlap uses per-block
[min, max] of the positive ids plus flags for id 0 (padding) and id < 0
(tail padding added here), which is exact for the packed layout (ids
non-decreasing, trailing zeros) and conservative for any other layout.

Position part, with diff = q_idx - k_idx ranging over [dmin, dmax] in a pair:
    non-empty iff (not causal or dmax >= 0) and (window is None or dmin < window)
    full      iff (not causal or dmin >= 0) and (window is None or dmax < window)

Ranges: kv_lo/kv_hi [B, nQ] bound the non-empty kv-blocks of each q-block
(forward and dQ kernels loop j in [kv_lo, kv_hi)); q_lo/q_hi [B, nK] bound the
non-empty q-blocks of each kv-block (dK/dV kernel).  Rows with no non-empty
block get lo == hi == 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

EMPTY, PARTIAL, FULL = 0, 1, 2
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128
PAD_SEGMENT_ID = -1  # id given to tail padding added to reach a block multiple


def _is_pow2(x: int) -> bool:
    return isinstance(x, int) and x > 0 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Block metadata for one packed batch (a pytree; static fields are aux data).

    Array fields:
      segment_ids  [B, Tp] int32  segment ids padded with -1 to Tp
      block_kind   [B, nQ, nK] int8  EMPTY / PARTIAL / FULL
      kv_lo, kv_hi [B, nQ] int32  kv-block range per q-block
      q_lo, q_hi   [B, nK] int32  q-block range per kv-block
      single_segment [] bool      every row is one segment (no packing, no padding): the batch is
                                  plain causal attention, so `auto` may take a dense kernel at run time
    Static fields: seq_len (T before padding), block_q, block_k, causal,
    sliding_window.
    """

    segment_ids: jax.Array
    block_kind: jax.Array
    kv_lo: jax.Array
    kv_hi: jax.Array
    q_lo: jax.Array
    q_hi: jax.Array
    single_segment: jax.Array
    seq_len: int
    block_q: int
    block_k: int
    causal: bool
    sliding_window: int | None

    def __post_init__(self):
        # Only static fields are validated: array leaves may be tracers or
        # placeholders during pytree transformations.
        for name in ("block_q", "block_k"):
            if not _is_pow2(getattr(self, name)):
                raise ValueError(
                    f"kernels_pallas/attention/metadata.py: AttentionMetadata.{name}="
                    f"{getattr(self, name)!r} must be a positive power of two (e.g. 64 or 128)."
                )
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(
                "kernels_pallas/attention/metadata.py: sliding_window="
                f"{self.sliding_window!r} must be None or an int >= 1."
            )

    @property
    def padded_len(self) -> int:
        return self.segment_ids.shape[-1]

    @property
    def num_q_blocks(self) -> int:
        return self.block_kind.shape[1]

    @property
    def num_kv_blocks(self) -> int:
        return self.block_kind.shape[2]


jax.tree_util.register_dataclass(
    AttentionMetadata,
    data_fields=["segment_ids", "block_kind", "kv_lo", "kv_hi", "q_lo", "q_hi", "single_segment"],
    meta_fields=["seq_len", "block_q", "block_k", "causal", "sliding_window"],
)


def check_compatible(metadata: "AttentionMetadata", t: int, causal: bool, sliding_window: int | None,
                     where: str) -> None:
    """Raises (naming `where`) unless `metadata` was built for this sequence length, causality and window."""
    if not isinstance(metadata, AttentionMetadata):
        raise ValueError(f"{where}: metadata must come from make_metadata(...), got {type(metadata)}.")
    if metadata.seq_len != t:
        raise ValueError(f"{where}: metadata was built for T={metadata.seq_len} but q has T={t}.")
    if metadata.causal != bool(causal) or metadata.sliding_window != sliding_window:
        raise ValueError(
            f"{where}: metadata was built with causal={metadata.causal}, "
            f"sliding_window={metadata.sliding_window} but the call uses causal={causal}, "
            f"sliding_window={sliding_window}; rebuild it with make_metadata(...)."
        )


def padded_length(seq_len: int, block_q: int, block_k: int) -> int:
    m = max(block_q, block_k)  # both powers of two: the max is a common multiple
    return -(-seq_len // m) * m


def _block_summary(seg: jax.Array, block: int):
    """Per-block (min id>0, max id>0, has 0, has <0, min id, max id)."""
    b, tp = seg.shape
    x = seg.reshape(b, tp // block, block)
    pos = x > 0
    big = jnp.iinfo(jnp.int32).max
    pmin = jnp.min(jnp.where(pos, x, big), axis=-1)
    pmax = jnp.max(jnp.where(pos, x, -1), axis=-1)
    has0 = jnp.any(x == 0, axis=-1)
    hasneg = jnp.any(x < 0, axis=-1)
    return pmin, pmax, has0, hasneg, jnp.min(x, axis=-1), jnp.max(x, axis=-1)


def _range(nonempty: jax.Array, axis: int):
    """[lo, hi) of the True entries along ``axis`` (0, 0 when none)."""
    n = nonempty.shape[axis]
    idx = jnp.arange(n, dtype=jnp.int32)
    shape = [1] * nonempty.ndim
    shape[axis] = n
    idx = idx.reshape(shape)
    anyv = jnp.any(nonempty, axis=axis)
    lo = jnp.min(jnp.where(nonempty, idx, n), axis=axis)
    hi = jnp.max(jnp.where(nonempty, idx + 1, 0), axis=axis)
    return jnp.where(anyv, lo, 0).astype(jnp.int32), jnp.where(anyv, hi, 0).astype(jnp.int32)


def make_metadata(
    segment_ids: jax.Array,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> AttentionMetadata:
    """Build the block metadata of one batch from ``segment_ids`` [B, T] int.

    Jittable (T, block sizes, causal, window are static).  The kernels accept
    any metadata whose block sizes are multiples of their own tile sizes, so
    the defaults (128 x 128) serve every head_dim and both passes.
    """
    block_q = DEFAULT_BLOCK_Q if block_q is None else block_q
    block_k = DEFAULT_BLOCK_K if block_k is None else block_k
    if getattr(segment_ids, "ndim", None) != 2:
        raise ValueError(
            "kernels_pallas/attention/metadata.py: make_metadata(segment_ids) needs a "
            f"[B, T] integer array, got shape {getattr(segment_ids, 'shape', None)}."
        )
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(
            "kernels_pallas/attention/metadata.py: segment_ids must be integer "
            f"(documents 1..n, 0 = padding), got dtype {segment_ids.dtype}."
        )
    for name, val in (("block_q", block_q), ("block_k", block_k)):
        if not _is_pow2(val):
            raise ValueError(
                f"kernels_pallas/attention/metadata.py: make_metadata({name}={val!r}) "
                "must be a positive power of two."
            )
    b, t = segment_ids.shape
    tp = padded_length(t, block_q, block_k)
    seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, tp - t)),
                  constant_values=PAD_SEGMENT_ID)
    nq, nk = tp // block_q, tp // block_k

    qs = _block_summary(seg, block_q)
    ks = _block_summary(seg, block_k)
    qpmin, qpmax, q0, qneg, qmin, qmax = (a[:, :, None] for a in qs)
    kpmin, kpmax, k0, kneg, kmin, kmax = (a[:, None, :] for a in ks)
    seg_overlap = (
        (jnp.maximum(qpmin, kpmin) <= jnp.minimum(qpmax, kpmax))
        | (q0 & k0)
        | (qneg & kneg)
    )
    seg_full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)

    qi = jnp.arange(nq, dtype=jnp.int32)[:, None]
    kj = jnp.arange(nk, dtype=jnp.int32)[None, :]
    dmin = qi * block_q - (kj * block_k + block_k - 1)
    dmax = qi * block_q + block_q - 1 - kj * block_k
    pos_nonempty = jnp.ones((nq, nk), bool)
    pos_full = jnp.ones((nq, nk), bool)
    if causal:
        pos_nonempty &= dmax >= 0
        pos_full &= dmin >= 0
    if sliding_window is not None:
        pos_nonempty &= dmin < sliding_window
        pos_full &= dmax < sliding_window

    nonempty = seg_overlap & pos_nonempty[None]
    full = nonempty & seg_full & pos_full[None]
    kind = jnp.where(full, FULL, jnp.where(nonempty, PARTIAL, EMPTY)).astype(jnp.int8)
    kv_lo, kv_hi = _range(nonempty, axis=2)
    q_lo, q_hi = _range(nonempty, axis=1)
    return AttentionMetadata(
        segment_ids=seg, block_kind=kind, kv_lo=kv_lo, kv_hi=kv_hi, q_lo=q_lo,
        q_hi=q_hi, single_segment=jnp.all(segment_ids == segment_ids[:, :1]), seq_len=t,
        block_q=block_q, block_k=block_k, causal=bool(causal),
        sliding_window=None if sliding_window is None else int(sliding_window),
    )


def kept_pairs(segment_ids, window: int | None = None) -> int:
    """(query, key) pairs a causal mask keeps over the rows of ``segment_ids`` [..., T]: a run of one id is one
    document (a row's padding is a run too, since the kernels attend it), and each query sees at most ``window``
    keys (itself included) when one is given. Per document of n tokens: n (n + 1) / 2, or with w = min(n, window)
    w (w + 1) / 2 + (n - w) w. The benchmarks' useful FLOPs and remat's cost model both count pairs this way."""
    ids = np.asarray(segment_ids)
    rows = ids.reshape(-1, ids.shape[-1])
    # Document boundaries of every row at once: a start at each row's first token and at each change of id.
    starts = np.ones(rows.shape, bool)
    starts[:, 1:] = rows[:, 1:] != rows[:, :-1]
    flat = np.flatnonzero(starts.reshape(-1))
    n = np.diff(np.append(flat, rows.size)).astype(np.int64)
    w = n if window is None else np.minimum(n, window)
    return int((w * (w + 1) // 2 + (n - w) * w).sum())
