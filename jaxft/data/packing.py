"""Pack documents into fixed-length rows and serve deterministic batches.

Packing is best-fit decreasing (documents longest first, each into the open row whose
free space is the smallest that still fits it, else a new row). It has the same 11/9·OPT
asymptotic worst case as first-fit decreasing and never leaves a document out of a row
that could hold it; open rows are kept in buckets by free space, so each document costs
one bisect over at most ``max_seq_length`` distinct free-space values.

Batch ``step`` is row block ``step % nb`` of epoch ``step // nb`` (``nb`` =
`PackedDataset.num_batches_per_epoch`), where an epoch visits all rows in the order of a
permutation seeded by ``(seed, epoch)``: the batch is a pure function of
(data, max_seq_length, batch_size, seed, step), so training resumes at any step.

Per row, with documents d_1..d_k laid out back to back from column 0:
  input_ids[t]   = token at t (0 on padding)
  targets[t]     = input_ids[t+1] when t+1 is in the same document, else 0
  loss_mask[t]   = 1.0 iff targets[t] is a trained token of the same document
                   (so 0 at each document's last token and on padding)
  segment_ids[t] = j for document d_j, 0 on padding
  positions[t]   = t - start(d_j) (restarts at 0 per document; padding counts 0, 1, ...)

Documents with images (vision-language models, `jaxft.data.images`) add two keys, so that every batch array is
[rows, ...] and row-split, stacked into micro-batches and placed like the token arrays:
  pixel_values[r]   float32 [P * patch_dim]: the patches of row r's images (its documents' images in layout
                    order, each as the image processor emits it), zero after them; P = the largest row's patches
  image_grid_thw[r] int32 [G * 3]: their (t, h, w) grids, zero after them; G = the most images a row holds
`jaxft.models.vision.model.flat_images` turns them back into the processor's flat [N, patch_dim] / [I, 3] form on
the device. A document longer than max_seq_length is cut before the first image that does not fit whole (an image's
tokens are never split from its pixels).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import logging
import math
from typing import Iterator, Literal, Sequence

import numpy as np

from jaxft.data.errors import DataConfigError, EmptyDatasetError
from jaxft.data.formatting import Document
from jaxft.data.sources import split_source

logger = logging.getLogger("jaxft.data")

Overlong = Literal["truncate", "drop"]
OVERLONG = ("truncate", "drop")


@dataclasses.dataclass(frozen=True)
class PackingStats:
    """What packing kept and lost.

    ``num_input = num_documents + dropped + skipped``; ``truncated`` counts kept documents
    that were cut to ``max_seq_length``; ``skipped`` counts documents with no trained target
    (no assistant reply, or all of it cut off by truncation).
    efficiency = real_tokens / (num_rows · max_seq_length).
    """

    max_seq_length: int
    num_input: int
    num_documents: int
    num_rows: int
    real_tokens: int
    trained_tokens: int
    truncated: int
    dropped: int
    skipped: int

    def __post_init__(self):
        if self.num_input != self.num_documents + self.dropped + self.skipped:
            raise ValueError(f"inconsistent packing stats: {self}")

    @property
    def efficiency(self) -> float:
        return self.real_tokens / (self.num_rows * self.max_seq_length) if self.num_rows else 0.0

    def summary(self) -> str:
        return (
            f"packed {self.num_documents}/{self.num_input} documents into {self.num_rows} rows of "
            f"{self.max_seq_length} tokens: efficiency {100 * self.efficiency:.1f}% ({self.real_tokens} "
            f"tokens, {self.trained_tokens} trained); {self.truncated} truncated to max_seq_length, "
            f"{self.dropped} dropped, {self.skipped} skipped (no target tokens)"
        )


_NAMED = 3  # documents named per kind of loss; the rest are counted


class _Named:
    """How many documents lost something, and the first few of them as (source, token count, detail)."""

    def __init__(self):
        self.count = 0
        self.first: list[tuple[str, int, str]] = []

    def add(self, source: str, num_tokens: int, detail: str = "") -> None:
        self.count += 1
        if len(self.first) < _NAMED:
            self.first.append((source, num_tokens, detail))

    def listing(self) -> str:
        """``d.jsonl:17 (812 tokens), :45 (640), and 3 more``: the file is named once per run of it."""
        parts, prev = [], None
        for i, (source, n, detail) in enumerate(self.first):
            file, place = split_source(source)
            where = place if file == prev and place else source
            parts.append(f"{where} ({n}{' tokens' if i == 0 else ''}{detail})")
            prev = file
        more = self.count - len(self.first)
        return ", ".join(parts) + (f", and {more} more" if more else "")


def _loss_notes(lost: dict[str, _Named], max_seq_length: int) -> list[str]:
    """One line per kind of loss that happened, naming the documents and the fix."""
    notes = []
    limit = f"max_seq_length={max_seq_length}"
    t, d, c, u = (lost[k] for k in ("truncated", "dropped", "cut", "untrained"))
    if t.count:
        notes.append(f"{_docs(t.count)} longer than {limit} {_verb(t.count, 'was', 'were')} truncated: "
                     f"{t.listing()}; raise max_seq_length to keep them whole")
    if d.count:
        notes.append(f"{_docs(d.count)} longer than {limit} {_verb(d.count, 'was', 'were')} dropped "
                     f"(overlong='drop'): {d.listing()}; raise max_seq_length or use overlong='truncate'")
    if c.count:
        notes.append(f"{_docs(c.count)} {_verb(c.count, 'has', 'have')} no target tokens left after truncation "
                     f"to {limit} and {_verb(c.count, 'was', 'were')} skipped: {c.listing()}; raise "
                     "max_seq_length or shorten the prompts")
    if u.count:
        notes.append(f"{_docs(u.count)} {_verb(u.count, 'has', 'have')} no target tokens (e.g. a chat without an "
                     f"assistant reply) and {_verb(u.count, 'was', 'were')} skipped: {u.listing()}; fix the records")
    return notes


def _docs(n: int) -> str:
    return "1 document" if n == 1 else f"{n} documents"


def _verb(n: int, singular: str, plural: str) -> str:
    return singular if n == 1 else plural


def _image_cut(doc: Document, max_seq_length: int, images) -> tuple[int, tuple]:
    """(tokens kept, images kept) of a document cut to max_seq_length: before the first image that does not fit
    whole."""
    if not doc.images:
        return max_seq_length, ()
    at = np.flatnonzero(doc.tokens == images.image_token_id)  # the images' tokens, image after image
    kept, used = [], 0
    for im in doc.images:
        n = im.num_patches // images.merge_unit
        first, last = int(at[used]), int(at[used + n - 1])
        if last >= max_seq_length:
            return first, tuple(kept)
        kept.append(im)
        used += n
    return max_seq_length, tuple(kept)


def best_fit_decreasing(lengths: Sequence[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """Bin-pack items of the given lengths (each ``1 <= length <= capacity``); returns the item
    indices of each bin, deterministic (ties broken by item index)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"item lengths must be in [1, {capacity}]")
    bins: list[list[int]] = []
    by_free: list[list[int]] = [[] for _ in range(capacity + 1)]  # free space -> open bins
    free_sizes: list[int] = []  # sorted free-space values that have an open bin
    for item in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[item])
        k = bisect.bisect_left(free_sizes, n)
        if k == len(free_sizes):
            b, left = len(bins), capacity - n
            bins.append([])
        else:
            free = free_sizes[k]
            b = by_free[free].pop()
            if not by_free[free]:
                free_sizes.pop(k)
            left = free - n
        bins[b].append(item)
        if left > 0:
            if not by_free[left]:
                bisect.insort(free_sizes, left)
            by_free[left].append(b)
    return bins


class PackedDataset:
    """Documents packed into rows of ``max_seq_length``; batches are [batch_size, max_seq_length] host arrays.

    The last batch of an epoch is filled up with all-padding rows (loss_mask 0), so every
    batch has the same shape and no row is left out.
    """

    def __init__(
        self,
        documents: Sequence[Document],
        *,
        max_seq_length: int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        overlong: Overlong = "truncate",
        name: str = "train",
        images=None,
    ):
        if not isinstance(max_seq_length, int) or max_seq_length < 2:
            raise DataConfigError(f"max_seq_length must be an int >= 2, got {max_seq_length!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise DataConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if overlong not in OVERLONG:
            raise DataConfigError(f"overlong={overlong!r} is not one of {OVERLONG}")
        self.max_seq_length, self.batch_size, self.seed, self.shuffle, self.name = (
            max_seq_length, batch_size, int(seed), bool(shuffle), name,
        )

        self.images = images  # jaxft.data.images.ImageProcessor when documents may hold images
        kept_tokens, kept_masks, kept_images = [], [], []
        # Documents that lost something, by what they lost: (count, first few (source, detail)).
        lost = {k: _Named() for k in ("truncated", "dropped", "cut", "untrained")}
        for doc in documents:
            tokens, mask = doc.tokens, doc.loss_mask
            if len(tokens) > max_seq_length:
                if overlong == "drop":
                    lost["dropped"].add(doc.source, len(tokens))
                    continue
                cut, doc_images = _image_cut(doc, max_seq_length, images)
                tokens, mask = tokens[:cut], mask[:cut]
            else:
                doc_images = doc.images
            if not mask[1:].any():
                if doc.loss_mask[1:].any():  # it had targets, all beyond max_seq_length
                    first = int(np.flatnonzero(doc.loss_mask[1:])[0]) + 1
                    lost["cut"].add(doc.source, len(doc.tokens), f", first target at token {first}")
                else:
                    lost["untrained"].add(doc.source, len(doc.tokens))
                continue
            if len(tokens) < len(doc.tokens):
                lost["truncated"].add(doc.source, len(doc.tokens))
            kept_tokens.append(tokens)
            kept_masks.append(mask)
            kept_images.append(tuple(doc_images))
        truncated, dropped = lost["truncated"].count, lost["dropped"].count
        skipped = lost["cut"].count + lost["untrained"].count
        notes = _loss_notes(lost, max_seq_length)

        lengths = np.array([len(t) for t in kept_tokens], dtype=np.int64)
        self._doc_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self._doc_len = lengths
        self._tokens = np.concatenate(kept_tokens) if kept_tokens else np.zeros(0, np.int32)
        self._mask = np.concatenate(kept_masks) if kept_masks else np.zeros(0, bool)
        self._rows = [np.array(r, dtype=np.int64) for r in best_fit_decreasing(lengths, max_seq_length)]
        self._images = kept_images
        # Per-row image budgets (static batch shapes): the most patches / images any row holds.
        self.max_row_patches = max((sum(im.num_patches for d in r for im in kept_images[d]) for r in self._rows),
                                   default=0)
        self.max_row_images = max((sum(len(kept_images[d]) for d in r) for r in self._rows), default=0)
        if self.max_row_images and images is None:
            raise DataConfigError(f"{name} data: documents hold images but no image processor was given")
        self.stats = PackingStats(
            max_seq_length=max_seq_length,
            num_input=len(documents),
            num_documents=len(kept_tokens),
            num_rows=len(self._rows),
            real_tokens=int(lengths.sum()),
            trained_tokens=int(sum(m[1:].sum() for m in kept_masks)),
            truncated=int(truncated),
            dropped=dropped,
            skipped=skipped,
        )
        if not self._rows:
            raise EmptyDatasetError(
                f"{name} data: no trainable document left of {len(documents)}: {'; '.join(notes)}"
            )
        self._epoch_cache: tuple[int, np.ndarray] | None = None
        for note in notes:
            logger.warning("%s data: %s", name, note)
        logger.info("%s data: %s", name, self.stats.summary())

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def fingerprint(self) -> str:
        """sha256 of the kept documents' tokens, loss masks and lengths (in input order): what a checkpoint
        records so that a resume on other data is refused."""
        h = hashlib.sha256()
        for part in (self._doc_len, self._tokens, self._mask):
            h.update(np.ascontiguousarray(part).tobytes())
        return h.hexdigest()

    @property
    def num_batches_per_epoch(self) -> int:
        return math.ceil(self.num_rows / self.batch_size)

    def __len__(self) -> int:
        return self.num_batches_per_epoch

    def epoch_of(self, step: int) -> int:
        return step // self.num_batches_per_epoch

    def row_order(self, epoch: int) -> np.ndarray:
        """Permutation of row indices visited in ``epoch`` (identity when not shuffling)."""
        if not self.shuffle:
            return np.arange(self.num_rows)
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch_cache = (epoch, rng.permutation(self.num_rows))
        return self._epoch_cache[1]

    def rows_of(self, step: int) -> np.ndarray:
        """Row indices (into the packed rows) making up batch ``step``; may be fewer than batch_size."""
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        epoch, i = divmod(int(step), self.num_batches_per_epoch)
        return self.row_order(epoch)[i * self.batch_size : (i + 1) * self.batch_size]

    def row_documents(self, row: int) -> np.ndarray:
        """Indices of the kept documents packed into ``row``, in layout order."""
        return self._rows[row]

    def batch(self, step: int, slots: Sequence[int] | np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The packed batch of global step ``step`` (see the module docstring for the layout).

        ``slots``: only these rows (indices into the batch's ``batch_size`` rows, in the order given) are packed,
        so ``batch(step, slots) == batch(step)[slots]``; a process of a multi-process run packs only the rows its
        devices hold (`jaxft.sharding.Placement.local_rows`)."""
        t = self.max_seq_length
        slots = np.arange(self.batch_size) if slots is None else np.asarray(slots, dtype=np.int64).reshape(-1)
        if slots.size and (slots.min() < 0 or slots.max() >= self.batch_size):
            raise ValueError(f"batch slots must be in [0, {self.batch_size}), got {slots.min()}..{slots.max()}")
        b = len(slots)
        out = {
            "input_ids": np.zeros((b, t), np.int32),
            "targets": np.zeros((b, t), np.int32),
            "loss_mask": np.zeros((b, t), np.float32),
            "segment_ids": np.zeros((b, t), np.int32),
            "positions": np.zeros((b, t), np.int32),
        }
        rows = self.rows_of(step)
        for r, slot in enumerate(slots.tolist()):
            pos = 0
            if slot < len(rows):
                for j, d in enumerate(self._rows[rows[slot]].tolist(), start=1):
                    s, n = int(self._doc_start[d]), int(self._doc_len[d])
                    out["input_ids"][r, pos : pos + n] = self._tokens[s : s + n]
                    out["targets"][r, pos : pos + n - 1] = self._tokens[s + 1 : s + n]
                    out["loss_mask"][r, pos : pos + n - 1] = self._mask[s + 1 : s + n]
                    out["segment_ids"][r, pos : pos + n] = j
                    out["positions"][r, pos : pos + n] = np.arange(n, dtype=np.int32)
                    pos += n
            out["positions"][r, pos:] = np.arange(t - pos, dtype=np.int32)
        # Masked targets are 0 by contract, even where the next token exists.
        out["targets"] *= out["loss_mask"].astype(np.int32)
        if self.max_row_images:
            out.update(self._row_images(rows, slots))
        return out

    def _row_images(self, rows: np.ndarray, slots: np.ndarray) -> dict[str, np.ndarray]:
        """pixel_values [b, P * patch_dim] and image_grid_thw [b, G * 3] of the batch rows (module docstring)."""
        dim = self.images.patch_dim
        pixels = np.zeros((len(slots), self.max_row_patches * dim), np.float32)
        grids = np.zeros((len(slots), self.max_row_images * 3), np.int32)
        for r, slot in enumerate(slots.tolist()):
            refs = [im for d in self._rows[rows[slot]].tolist() for im in self._images[d]] if slot < len(rows) else []
            if not refs:
                continue
            values, grid = self.images.process(refs)
            if [tuple(g) for g in grid.tolist()] != [im.grid for im in refs] or values.shape[1] != dim:
                raise DataConfigError(f"{refs[0].source}: the image processor gave other grids than when the data "
                                      f"was tokenized ({grid.tolist()} vs {[im.grid for im in refs]})")
            pixels[r, : values.size] = values.reshape(-1)
            grids[r, : grid.size] = grid.reshape(-1)
        return {"pixel_values": pixels, "image_grid_thw": grids}

    def num_tokens(self, step: int) -> int:
        """Non-padding tokens of batch ``step`` (= nonzero ``segment_ids`` of ``batch(step)``), without packing it:
        every process of a multi-process run counts the whole batch's tokens from the row index alone."""
        return int(sum(int(self._doc_len[self._rows[r]].sum()) for r in self.rows_of(step)))

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """The batches of epoch 0, in order (for evaluation)."""
        for step in range(self.num_batches_per_epoch):
            yield self.batch(step)
