"""Block metadata (kernels_pallas/attention/metadata.py) vs a brute-force mask.

Soundness for every layout: EMPTY blocks keep no pair, FULL blocks keep every
pair, and [lo, hi) ranges cover every non-empty block.  Exactness for packed
layouts (contiguous documents, ids 1..n, trailing padding 0): the labels equal
the brute-force classification and the ranges are tight.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.attention import AttentionMetadata, make_metadata
from kernels_pallas.attention.metadata import EMPTY, FULL, PARTIAL, PAD_SEGMENT_ID


def _packed_row(rng, t, pad):
    seg = np.zeros(t, np.int32)
    pos, doc = 0, 1
    while pos < t - pad:
        n = int(rng.integers(1, 90))
        seg[pos:min(pos + n, t - pad)] = doc
        pos += n
        doc += 1
    return seg


def _brute_kinds(seg, bq, bk, causal, window):
    """Classify block pairs from the dense [Tp, Tp] keep-mask (numpy)."""
    b, t = seg.shape
    m = max(bq, bk)
    tp = -(-t // m) * m
    segp = np.full((b, tp), PAD_SEGMENT_ID, np.int32)
    segp[:, :t] = seg
    i = np.arange(tp)[:, None]
    j = np.arange(tp)[None, :]
    keep = segp[:, :, None] == segp[:, None, :]
    if causal:
        keep &= (i - j >= 0)[None]
    if window is not None:
        keep &= (i - j < window)[None]
    blocks = keep.reshape(b, tp // bq, bq, tp // bk, bk)
    anyk = blocks.any(axis=(2, 4))
    allk = blocks.all(axis=(2, 4))
    return np.where(allk, FULL, np.where(anyk, PARTIAL, EMPTY)), anyk


def _ranges(nonempty, axis):
    n = nonempty.shape[axis]
    idx = np.arange(n).reshape([-1 if a == axis else 1 for a in range(nonempty.ndim)])
    has = nonempty.any(axis=axis)
    lo = np.where(has, np.where(nonempty, idx, n).min(axis=axis), 0)
    hi = np.where(has, np.where(nonempty, idx + 1, 0).max(axis=axis), 0)
    return lo, hi


CASES = [
    # (causal, window, block_q, block_k)
    (True, None, 64, 64),
    (True, 50, 64, 32),
    (True, 200, 32, 64),
    (False, None, 64, 64),
    (False, 70, 32, 32),
]

# One program per case, shared by the two tests below (op by op, every eager op of a new shape compiles on its own).
_METADATA = jax.jit(make_metadata, static_argnames=("causal", "sliding_window", "block_q", "block_k"))


@pytest.mark.parametrize("causal,window,bq,bk", CASES)
def test_packed_layouts_are_classified_exactly(causal, window, bq, bk):
    rng = np.random.default_rng(0)
    t = 300  # not a block multiple: exercises the -1 tail padding
    seg = np.stack([_packed_row(rng, t, pad) for pad in (0, 37, 120, 1)])
    seg[3] = 1  # one dense row
    md = _METADATA(jnp.asarray(seg), causal=causal, sliding_window=window, block_q=bq, block_k=bk)
    kinds, nonempty = _brute_kinds(seg, bq, bk, causal, window)
    np.testing.assert_array_equal(np.asarray(md.block_kind), kinds)
    lo, hi = _ranges(nonempty, 2)
    np.testing.assert_array_equal(np.asarray(md.kv_lo), lo)
    np.testing.assert_array_equal(np.asarray(md.kv_hi), hi)
    lo, hi = _ranges(nonempty, 1)
    np.testing.assert_array_equal(np.asarray(md.q_lo), lo)
    np.testing.assert_array_equal(np.asarray(md.q_hi), hi)
    # Skipping must actually happen for packed rows.
    assert (np.asarray(md.block_kind)[:3] == EMPTY).any()


@pytest.mark.parametrize("causal,window,bq,bk", CASES)
def test_arbitrary_layouts_are_classified_soundly(causal, window, bq, bk):
    rng = np.random.default_rng(1)
    # Non-contiguous ids: the same id reappears after other ids. The packed test's shape (4, 300): the programs
    # compiled there serve here.
    seg = rng.integers(0, 4, size=(4, 300)).astype(np.int32)
    seg[1] = np.repeat(rng.integers(0, 5, size=19), 16)[:300]
    md = _METADATA(jnp.asarray(seg), causal=causal, sliding_window=window, block_q=bq, block_k=bk)
    kinds, nonempty = _brute_kinds(seg, bq, bk, causal, window)
    got = np.asarray(md.block_kind)
    assert not (nonempty & (got == EMPTY)).any(), "a non-empty block was labelled EMPTY"
    assert not ((kinds != FULL) & (got == FULL)).any(), "a block with masked pairs was labelled FULL"
    kv_lo, kv_hi = np.asarray(md.kv_lo), np.asarray(md.kv_hi)
    q_lo, q_hi = np.asarray(md.q_lo), np.asarray(md.q_hi)
    for b, i, j in zip(*np.nonzero(nonempty)):
        assert kv_lo[b, i] <= j < kv_hi[b, i]
        assert q_lo[b, j] <= i < q_hi[b, j]


def test_metadata_is_a_jittable_pytree_with_static_blocks():
    seg = jnp.asarray(np.repeat(np.arange(1, 5, dtype=np.int32), 64)[None])
    md = jax.jit(lambda s: make_metadata(s, sliding_window=100, block_q=64, block_k=32))(seg)
    assert isinstance(md, AttentionMetadata)
    leaves, treedef = jax.tree_util.tree_flatten(md)
    assert len(leaves) == 7  # six block arrays + the single_segment flag
    assert md.block_kind.dtype == jnp.int8 and md.block_kind.shape == (1, 4, 8)
    assert (md.block_q, md.block_k, md.causal, md.sliding_window, md.seq_len) == (64, 32, True, 100, 256)
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert again.block_q == 64 and again.padded_len == 256
    # Used as a jit argument, it is one object reused by every layer.
    n = jax.jit(lambda m: jnp.sum(m.block_kind == FULL))(md)
    assert int(n) == int(np.sum(np.asarray(md.block_kind) == FULL))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_q=48), "power of two"),
        (dict(sliding_window=0), "sliding_window"),
    ],
)
def test_bad_arguments_raise_with_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_metadata(jnp.ones((1, 128), jnp.int32), **kwargs)


def test_bad_segment_ids_raise():
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        make_metadata(jnp.ones((128,), jnp.int32))
    with pytest.raises(ValueError, match="integer"):
        make_metadata(jnp.ones((1, 128), jnp.float32))
