"""Data pipeline: records on disk -> tokenized documents -> packed host batches.

Typical use::

    train, evalset = build_datasets(DataConfig(path, max_seq_length=2048, batch_size=8), model_dir)
    batch = train.batch(step)   # dict of [B, T] numpy arrays (see jaxft.data.packing)
"""

from jaxft.data.errors import (
    ChatTemplateError,
    DataConfigError,
    DataError,
    DataFormatError,
    DataPathError,
    EmptyDatasetError,
    MissingFieldError,
    TokenizerError,
)
from jaxft.data.formatting import Document, Formatter, load_tokenizer, record_kind, tokenize_records
from jaxft.data.images import ImageError, ImageProcessor, ImageRef
from jaxft.data.packing import PackedDataset, PackingStats, best_fit_decreasing
from jaxft.data.pipeline import DataConfig, build_datasets
from jaxft.data.sources import Record, read_records

__all__ = [
    "ChatTemplateError",
    "DataConfig",
    "DataConfigError",
    "DataError",
    "DataFormatError",
    "DataPathError",
    "Document",
    "EmptyDatasetError",
    "Formatter",
    "ImageError",
    "ImageProcessor",
    "ImageRef",
    "MissingFieldError",
    "PackedDataset",
    "PackingStats",
    "Record",
    "TokenizerError",
    "best_fit_decreasing",
    "build_datasets",
    "load_tokenizer",
    "read_records",
    "record_kind",
    "tokenize_records",
]
