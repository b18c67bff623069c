"""Errors raised by the data pipeline.

Every error is a `DataError` (a `ValueError`) whose message names the offending
file (and line / record / key where there is one) and says how to fix it, so the
CLI can print ``str(err)`` alone instead of a traceback.
"""

from __future__ import annotations


class DataError(ValueError):
    """Base class: bad training data or a data/tokenizer setup problem."""


class DataConfigError(DataError):
    """An invalid data option (a DataConfig field such as max_seq_length, batch_size or overlong)."""


class DataPathError(DataError):
    """A data path that does not exist, has an unknown format, or holds no data files."""


class DataFormatError(DataError):
    """A file that cannot be parsed (malformed JSON line, unreadable Parquet/Arrow)."""


class MissingFieldError(DataError):
    """A record without the fields of any supported format, or with a field of the wrong type."""


class EmptyDatasetError(DataError):
    """No trainable document is left after reading, tokenizing and filtering."""


class TokenizerError(DataError):
    """The tokenizer cannot be loaded or lacks a token the format needs (e.g. EOS)."""


class ChatTemplateError(TokenizerError):
    """No chat template, or the template cannot render / delimit a conversation."""


def one_line(e: BaseException, limit: int = 300) -> str:
    """A library exception as one short line, for embedding in a `DataError` message."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit] + ' ...' if len(text) > limit else text}"
