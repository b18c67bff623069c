"""Packing: row layout invariants of the packed-batch contract, determinism, overlong handling."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from jaxft.data import (
    DataConfigError,
    Document,
    EmptyDatasetError,
    PackedDataset,
    best_fit_decreasing,
)

SEQ = 32


def make_docs(n: int, seed: int = 0, max_len: int = SEQ) -> list[Document]:
    """Documents with globally unique tokens (doc i holds i*1000 + 1 + k) and random masks."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        length = int(rng.integers(2, max_len + 1))
        mask = rng.random(length) < 0.6
        mask[-1] = True  # at least one trained target
        docs.append(Document(i * 1000 + 1 + np.arange(length), mask, f"doc{i}"))
    return docs


def first_fit_decreasing(lengths, cap):
    bins = []
    for n in sorted(lengths, reverse=True):
        for b in bins:
            if b[0] + n <= cap:
                b[0] += n
                break
        else:
            bins.append([n])
    return len(bins)


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_decreasing_is_a_valid_tight_packing(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 100, size=300)
    bins = best_fit_decreasing(lengths, 100)
    items = sorted(i for b in bins for i in b)
    assert items == list(range(len(lengths)))  # every item exactly once
    assert all(lengths[b].sum() <= 100 for b in bins)
    assert math.ceil(lengths.sum() / 100) <= len(bins) <= first_fit_decreasing(lengths.tolist(), 100)
    assert bins == best_fit_decreasing(lengths, 100)  # deterministic


def test_best_fit_rejects_items_longer_than_a_bin():
    with pytest.raises(ValueError, match=r"item lengths must be in \[1, 10\]"):
        best_fit_decreasing([3, 11], 10)


def check_row_invariants(batch, docs_by_first_token):
    """Check the packed-batch contract on every row; returns the documents found, as
    (doc index, tokens, per-target loss mask)."""
    b, t = batch["input_ids"].shape
    assert {k: (v.dtype, v.shape) for k, v in batch.items()} == {
        "input_ids": (np.int32, (b, t)), "targets": (np.int32, (b, t)),
        "loss_mask": (np.float32, (b, t)), "segment_ids": (np.int32, (b, t)),
        "positions": (np.int32, (b, t)),
    }
    found = []
    for r in range(b):
        seg, pos = batch["segment_ids"][r], batch["positions"][r]
        ids, tgt, lm = batch["input_ids"][r], batch["targets"][r], batch["loss_mask"][r]
        n_real = int((seg > 0).sum())
        assert (seg[:n_real] > 0).all() and (seg[n_real:] == 0).all()  # padding only at the tail
        assert (pos[n_real:] == np.arange(t - n_real)).all()  # padding positions 0, 1, ...
        assert (lm[n_real:] == 0).all() and (tgt[n_real:] == 0).all() and (ids[n_real:] == 0).all()
        assert set(np.unique(lm)) <= {0.0, 1.0}
        assert (tgt[lm == 0] == 0).all()  # masked targets are 0
        ids_seen = np.unique(seg[:n_real])
        assert (ids_seen == np.arange(1, len(ids_seen) + 1)).all()  # segments numbered 1..k
        for j in ids_seen:
            cols = np.flatnonzero(seg == j)
            assert (np.diff(cols) == 1).all()  # contiguous
            assert (pos[cols] == np.arange(len(cols))).all()  # positions restart
            s, e = cols[0], cols[-1]
            assert lm[e] == 0 and tgt[e] == 0  # no target crosses the document end
            assert (tgt[s:e] == ids[s + 1 : e + 1])[lm[s:e] == 1].all()  # next token, same doc
            d = docs_by_first_token[int(ids[s])]
            found.append((d, ids[s : e + 1].copy(), lm[s:e].astype(bool)))
    return found


@pytest.mark.parametrize("batch_size", [1, 3])
def test_packed_rows_follow_the_contract_and_hold_every_token_once(batch_size):
    docs = make_docs(40)
    ds = PackedDataset(docs, max_seq_length=SEQ, batch_size=batch_size, seed=1)
    by_first = {int(d.tokens[0]): i for i, d in enumerate(docs)}
    found = []
    n_tokens = 0
    for step in range(ds.num_batches_per_epoch):
        batch = ds.batch(step)
        found += check_row_invariants(batch, by_first)
        n_tokens += int((batch["segment_ids"] > 0).sum())
    assert sorted(f[0] for f in found) == list(range(len(docs)))  # each document exactly once
    for i, tokens, target_mask in found:
        assert (tokens == docs[i].tokens).all()
        assert (target_mask == docs[i].loss_mask[1:]).all()  # loss on trained next tokens only
    st = ds.stats
    assert st.real_tokens == n_tokens == sum(len(d) for d in docs)
    assert st.trained_tokens == sum(d.num_targets for d in docs)
    assert st.efficiency == pytest.approx(n_tokens / (ds.num_rows * SEQ))
    assert st.efficiency > 0.8  # random lengths in [2, 32] pack well
    assert ds.num_batches_per_epoch == math.ceil(ds.num_rows / batch_size)


def test_last_batch_is_filled_with_padding_rows():
    docs = [Document(np.arange(1, SEQ + 1), np.ones(SEQ, bool), f"d{i}") for i in range(5)]
    ds = PackedDataset(docs, max_seq_length=SEQ, batch_size=4, shuffle=False)
    assert ds.num_rows == 5 and ds.num_batches_per_epoch == 2
    last = ds.batch(1)
    assert (last["segment_ids"][0] == 1).all()
    assert (last["segment_ids"][1:] == 0).all() and (last["loss_mask"][1:] == 0).all()
    assert (last["positions"][1:] == np.arange(SEQ)).all()


def test_batches_are_a_pure_function_of_step_for_resume():
    docs = make_docs(60, seed=3)
    a = PackedDataset(docs, max_seq_length=SEQ, batch_size=2, seed=7)
    b = PackedDataset(docs, max_seq_length=SEQ, batch_size=2, seed=7)
    nb = a.num_batches_per_epoch
    steps = list(range(3 * nb))
    ref = {s: a.batch(s) for s in steps}
    for s in reversed(steps):  # a fresh dataset, steps visited in another order (resume)
        got = b.batch(s)
        for k in ref[s]:
            np.testing.assert_array_equal(got[k], ref[s][k])
    for epoch in range(3):  # each epoch visits every row once, in a new order
        rows = np.concatenate([a.rows_of(epoch * nb + i) for i in range(nb)])
        assert sorted(rows.tolist()) == list(range(a.num_rows))
    assert not np.array_equal(a.row_order(0), a.row_order(1))
    other_seed = PackedDataset(docs, max_seq_length=SEQ, batch_size=2, seed=8)
    assert not np.array_equal(a.row_order(0), other_seed.row_order(0))
    unshuffled = PackedDataset(docs, max_seq_length=SEQ, batch_size=2, shuffle=False)
    assert (unshuffled.row_order(5) == np.arange(unshuffled.num_rows)).all()
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        a.batch(-1)


def _long_docs():
    trained = np.ones(50, bool)
    late = np.zeros(50, bool)
    late[40:] = True  # only trained after max_seq_length: nothing left once truncated
    return [
        Document(1 + np.arange(50), trained, "long"),
        Document(1001 + np.arange(50), late, "late"),
        Document(2001 + np.arange(10), np.ones(10, bool), "short"),
        Document(3001 + np.arange(5), np.zeros(5, bool), "untrained"),
    ]


def test_overlong_truncate_is_counted(caplog):
    with caplog.at_level(logging.INFO, logger="jaxft.data"):
        ds = PackedDataset(_long_docs(), max_seq_length=SEQ, batch_size=2, overlong="truncate")
    st = ds.stats
    assert (st.num_input, st.num_documents, st.truncated, st.dropped, st.skipped) == (4, 2, 1, 0, 2)
    assert st.real_tokens == SEQ + 10 and st.num_rows == 2
    first = ds.batch(0)
    row_of_long = int(np.flatnonzero(first["input_ids"][:, 0] == 1)[0])
    assert (first["input_ids"][row_of_long] == 1 + np.arange(SEQ)).all()
    assert first["loss_mask"][row_of_long].sum() == SEQ - 1
    assert "efficiency" in caplog.text and "1 truncated to max_seq_length, 0 dropped, 2 skipped" in caplog.text


def test_overlong_drop_is_counted():
    st = PackedDataset(_long_docs(), max_seq_length=SEQ, batch_size=2, overlong="drop").stats
    assert (st.num_input, st.num_documents, st.truncated, st.dropped, st.skipped) == (4, 1, 0, 2, 1)
    assert st.real_tokens == 10 and st.efficiency == pytest.approx(10 / SEQ)


def test_nothing_left_after_filtering():
    docs = [Document(np.arange(1, 50), np.ones(49, bool), "long"), Document([1, 2], [0, 0], "x")]
    with pytest.raises(EmptyDatasetError) as e:
        PackedDataset(docs, max_seq_length=SEQ, batch_size=1, overlong="drop", name="eval")
    msg = str(e.value)
    assert msg.startswith("eval data: no trainable document left of 2: 1 document longer than max_seq_length=32 "
                          "was dropped (overlong='drop'): long (49 tokens); raise max_seq_length or use "
                          "overlong='truncate'; 1 document has no target tokens")
    assert msg.endswith("and was skipped: x (2 tokens); fix the records")


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(max_seq_length=1, batch_size=1), "max_seq_length must be an int >= 2"),
        (dict(max_seq_length=SEQ, batch_size=0), "batch_size must be an int >= 1"),
        (dict(max_seq_length=SEQ, batch_size=1, overlong="wrap"), "overlong='wrap' is not one of"),
    ],
)
def test_bad_packing_options(kwargs, pattern):
    with pytest.raises(DataConfigError, match=pattern):
        PackedDataset(make_docs(3), **kwargs)


def test_document_validates_shapes():
    with pytest.raises(ValueError, match=r"src: tokens \(3,\) and loss_mask \(2,\)"):
        Document([1, 2, 3], [True, False], "src")
