"""One call from a data config and a tokenizer to packed train/eval datasets."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jaxft.data.errors import DataConfigError, EmptyDatasetError
from jaxft.data.formatting import Document, Formatter, load_tokenizer
from jaxft.data.images import ImageProcessor
from jaxft.data.packing import OVERLONG, Overlong, PackedDataset
from jaxft.data.sources import parse_records


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the data is and how it becomes batches.

    path / eval_path: a file or directory (see `jaxft.data.sources`).
    max_seq_length: tokens per packed row (the `jaxft-train` key of that name); longer documents are cut to it
        (see ``overlong``).
    split / eval_split: split names when a path is a ``DatasetDict`` directory; an
        ``eval_split`` without ``eval_path`` is read from ``path``.
    eval_fraction: hold out this fraction of the training documents (seeded by ``seed``)
        when no eval path/split is given; 0 = no eval set.
    assistant_only_loss: chats train on the assistant replies only (False: every token).
    completion_only_loss: prompt/completion records train on the completion only (False: every
        token). Each flag acts on its own format only; plain text always trains every token.
    overlong: documents longer than max_seq_length are "truncate"d or "drop"ped.
    text_field: the field of plain-text records (TRL's ``dataset_text_field``).
    """

    path: str
    max_seq_length: int
    batch_size: int
    eval_path: str | None = None
    eval_fraction: float = 0.0
    split: str | None = None
    eval_split: str | None = None
    eval_batch_size: int | None = None
    seed: int = 0
    assistant_only_loss: bool = True
    completion_only_loss: bool = True
    overlong: Overlong = "truncate"
    text_field: str = "text"

    def __post_init__(self):
        if not isinstance(self.path, (str, Path)) or not str(self.path):
            raise DataConfigError(f"data path must be a non-empty string, got {self.path!r}")
        for key, low in (("max_seq_length", 2), ("batch_size", 1), ("eval_batch_size", 1)):
            v = getattr(self, key)
            if v is None and key == "eval_batch_size":
                continue  # defaults to batch_size
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise DataConfigError(f"DataConfig.{key} must be an int >= {low}, got {v!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise DataConfigError(f"DataConfig.seed must be a non-negative int, got {self.seed!r}")
        if not isinstance(self.eval_fraction, (int, float)) or not 0.0 <= self.eval_fraction < 1.0:
            raise DataConfigError(f"DataConfig.eval_fraction must be in [0, 1), got {self.eval_fraction!r}")
        if self.eval_fraction > 0 and (self.eval_path or self.eval_split):
            raise DataConfigError(
                "DataConfig.eval_fraction cannot be combined with eval_path/eval_split: use one of them"
            )
        for key in ("assistant_only_loss", "completion_only_loss"):
            if not isinstance(getattr(self, key), bool):
                raise DataConfigError(f"DataConfig.{key} must be True or False, got {getattr(self, key)!r}")
        if self.overlong not in OVERLONG:
            raise DataConfigError(f"DataConfig.overlong must be one of {OVERLONG}, got {self.overlong!r}")


def build_datasets(
    config: DataConfig, tokenizer, images=None
) -> tuple[PackedDataset, PackedDataset | None]:
    """Read, tokenize and pack the train (shuffled per epoch) and eval (in order) sets.

    ``tokenizer`` is a Hugging Face tokenizer or the path of a model directory holding one (a vision-language
    model's directory also gives the image processor). ``images``: a `jaxft.data.images.ImageProcessor` for
    chats with image parts (None: from the model directory when it is a vision-language model's).
    Raises a `DataError` subclass with a file/line/key and a fix on any bad input.
    """
    if isinstance(tokenizer, (str, Path)):
        if images is None:
            images = ImageProcessor.for_model_dir(tokenizer)
        tokenizer = load_tokenizer(tokenizer)
    fmt = Formatter(tokenizer, assistant_only_loss=config.assistant_only_loss,
                    completion_only_loss=config.completion_only_loss, images=images, text_field=config.text_field)
    train_docs = parse_records(config.path, config.split, fmt)
    eval_docs: list[Document] | None = None
    if config.eval_path or config.eval_split:
        eval_docs = parse_records(config.eval_path or config.path, config.eval_split, fmt)
    elif config.eval_fraction > 0:
        n_eval = max(1, round(len(train_docs) * config.eval_fraction))
        if n_eval >= len(train_docs):
            raise EmptyDatasetError(
                f"{config.path}: eval_fraction={config.eval_fraction} of {len(train_docs)} "
                "documents leaves no training data; lower DataConfig.eval_fraction or add data"
            )
        perm = np.random.default_rng([config.seed, 0x5EED]).permutation(len(train_docs))
        held = set(perm[:n_eval].tolist())
        eval_docs = [d for i, d in enumerate(train_docs) if i in held]
        train_docs = [d for i, d in enumerate(train_docs) if i not in held]

    common = dict(max_seq_length=config.max_seq_length, overlong=config.overlong, seed=config.seed, images=images)
    train = PackedDataset(train_docs, batch_size=config.batch_size, shuffle=True, name="train", **common)
    evalset = None
    if eval_docs is not None:
        evalset = PackedDataset(
            eval_docs,
            batch_size=config.eval_batch_size or config.batch_size,
            shuffle=False,
            name="eval",
            **common,
        )
    return train, evalset
