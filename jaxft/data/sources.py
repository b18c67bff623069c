"""Read training records from disk.

Supported inputs (chosen from the path, no option needed):

* ``*.jsonl`` / ``*.ndjson``: one JSON object per line (blank lines skipped).
* ``*.json``: a JSON array of objects, or ``{"data": [...]}``; a ``.json`` file that is
  really JSON Lines (what ``datasets.Dataset.to_json`` writes) is read as JSON Lines.
* ``*.parquet``: every row is a record.
* ``*.arrow``: an Arrow IPC stream (or IPC file).
* A ``datasets`` ``save_to_disk`` directory, read without the ``datasets`` package:
  a ``Dataset`` directory (``state.json`` / ``dataset_info.json`` + ``*.arrow`` IPC
  streams) or a ``DatasetDict`` directory (``dataset_dict.json`` + one such
  subdirectory per split).
* Any other directory: every supported file directly inside it, in name order.

Each record keeps where it came from (``file:line`` for JSON Lines, ``file (row i)``
for columnar files) so later errors can point at it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from bridge.errors import hub_id_hint
from jaxft.data.errors import DataFormatError, DataPathError, EmptyDatasetError, MissingFieldError, one_line

_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_SUFFIXES = (*_JSONL_SUFFIXES, ".json", ".parquet", ".arrow")
_MAX_BAD_LINES = 10  # bad JSON Lines named in one error message
_MAX_BAD_RECORDS = 10  # records that cannot be trained on, named in one error message
T = TypeVar("T")
# The largest record read (its JSON text, or its strings' UTF-8 bytes for columnar files). Tokenizing a record
# costs far more memory than its text (a 100 MB chat record took 18 GB), and 16 MiB is some 4M tokens of text:
# more than any sequence length trains on.
MAX_RECORD_BYTES = 16 * 2**20
_HINT = (
    "use a .jsonl/.json/.parquet/.arrow file, a directory of such files, or a directory "
    "written by datasets' save_to_disk"
)


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """One raw training example and where it was read from (for error messages)."""

    data: dict[str, Any]
    source: str

    def __post_init__(self):
        if not isinstance(self.data, dict):
            raise TypeError(f"Record.data must be a dict, got {type(self.data).__name__}")


_LOCATOR = re.compile(r"^(?P<file>.+?)(?::(?P<line>\d+)| \((?P<row>(?:row|record) \d+)\))$")


def split_source(source: str) -> tuple[str, str]:
    """A `Record.source` as (file, place in it): ``("d.jsonl", ":17")``, ``("d.parquet", "row 3")``;
    ``(source, "")`` when it names no line or row. Lets a list of sources name the file once."""
    m = _LOCATOR.match(source)
    if m is None:
        return source, ""
    return m["file"], f":{m['line']}" if m["line"] else m["row"]


def read_records(path: str | Path, *, split: str | None = None) -> list[Record]:
    """Read every record under ``path``.

    ``split`` selects the split of a ``DatasetDict`` directory (default: ``"train"``,
    or the only split when there is one); it is ignored for other inputs.
    """
    return list(iter_records(path, split=split))


def iter_records(path: str | Path, *, split: str | None = None) -> Iterator[Record]:
    """Stream records file by file (same inputs as `read_records`)."""
    for file in data_files(path, split=split):
        yield from _read_file(file)


def parse_records(path: str | Path, split: str | None, parse: Callable[[Record], T], what: str = "records"
                  ) -> list[T]:
    """`parse` of every record. Records it refuses (`MissingFieldError`: no supported format, a field of the wrong
    type) are all reported in one error, the first `_MAX_BAD_RECORDS` named (file:line and why), the rest counted,
    so a user fixes a file in one pass; no records at all is an error too."""
    parsed, bad = [], []
    for record in iter_records(path, split=split):
        try:
            parsed.append(parse(record))
        except MissingFieldError as e:
            bad.append(e)
    if len(bad) == 1:
        raise bad[0]
    if bad:
        more = f"; and {len(bad) - _MAX_BAD_RECORDS} more" if len(bad) > _MAX_BAD_RECORDS else ""
        raise MissingFieldError(f"{len(bad)} {what} cannot be trained on: "
                                + "; ".join(str(e) for e in bad[:_MAX_BAD_RECORDS]) + more)
    if not parsed:
        raise EmptyDatasetError(f"{path}{f' (split {split!r})' if split else ''}: no records found; add data or fix "
                                "the data path")
    return parsed


def data_files(path: str | Path, *, split: str | None = None) -> list[Path]:
    """The data files that ``path`` stands for, in reading order."""
    p = Path(path).expanduser()
    if not p.exists():
        hint = hub_id_hint(path, repo_type="dataset") or f"; fix the path ({_HINT})"
        raise DataPathError(f"data path {str(p)!r} does not exist{hint}")
    if p.is_file():
        if p.suffix.lower() not in _SUFFIXES:
            raise DataPathError(f"{p}: unsupported file type {p.suffix!r}; {_HINT}")
        return [p]
    if (p / "dataset_dict.json").is_file():
        return _dataset_dir_files(_dataset_dict_split(p, split))
    if (p / "state.json").is_file() or (p / "dataset_info.json").is_file():
        return _dataset_dir_files(p)
    files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in _SUFFIXES)
    if not files:
        raise DataPathError(f"directory {p} holds no data files; {_HINT}")
    return files


def _load_json_file(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataFormatError(f"{file}: cannot parse ({one_line(e)}); fix or regenerate the file") from None


def _dataset_dict_split(root: Path, split: str | None) -> Path:
    meta = _load_json_file(root / "dataset_dict.json")
    splits = meta.get("splits") if isinstance(meta, dict) else None
    if not isinstance(splits, list) or not splits:
        raise DataFormatError(
            f"{root / 'dataset_dict.json'}: key 'splits' must be a non-empty list of split "
            "names; re-save the DatasetDict with save_to_disk"
        )
    if split is None:
        split = "train" if "train" in splits or len(splits) != 1 else splits[0]
    if split not in splits:
        raise DataPathError(
            f"{root}: DatasetDict has no split {split!r} (splits: {', '.join(map(str, splits))}); "
            "choose one of them as the data split"
        )
    sub = root / split
    if not sub.is_dir():
        raise DataPathError(f"{root}: split {split!r} is listed but directory {sub} is missing")
    return sub


def _dataset_dir_files(d: Path) -> list[Path]:
    """Arrow files of a datasets ``Dataset.save_to_disk`` directory, in shard order."""
    names: list[str] = []
    state_file = d / "state.json"
    if state_file.is_file():
        state = _load_json_file(state_file)
        entries = state.get("_data_files") if isinstance(state, dict) else None
        if isinstance(entries, list):
            names = [e["filename"] for e in entries if isinstance(e, dict) and "filename" in e]
    files = [d / n for n in names] if names else sorted(d.glob("*.arrow"))
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise DataPathError(f"{d}: state.json lists {missing[0].name} but the file is missing")
    if not files:
        raise DataPathError(f"dataset directory {d} holds no *.arrow files; {_HINT}")
    return files


def _read_file(file: Path) -> Iterator[Record]:
    suffix = file.suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        yield from _read_jsonl(file)
    elif suffix == ".json":
        yield from _read_json(file)
    elif suffix == ".parquet":
        yield from _read_parquet(file)
    else:
        yield from _read_arrow(file)


def _read_jsonl(file: Path) -> Iterator[Record]:
    """Records of a JSON Lines file; bad lines are collected and reported together.

    Once a bad line is seen no more records are yielded (the run fails anyway), but the rest of
    the file is still scanned so one message names up to `_MAX_BAD_LINES` bad lines and the count.
    """
    bad: list[str] = []
    num_bad = 0
    # Bytes per line, decoded one by one, so a bad UTF-8 sequence gets its own line number.
    with file.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            _check_record_size(len(raw), f"{file}:{lineno}")
            obj, problem = _parse_line(raw, first=lineno == 1)
            if problem is not None:
                num_bad += 1
                if len(bad) < _MAX_BAD_LINES:
                    bad.append(f"line {lineno} {problem}")
            elif obj is not None and not num_bad:
                yield Record(obj, f"{file}:{lineno}")
    if num_bad:
        more = f", and {num_bad - len(bad)} more" if num_bad > len(bad) else ""
        what = "1 line is not a valid JSON object" if num_bad == 1 else f"{num_bad} lines are not valid JSON objects"
        raise DataFormatError(
            f"{file}: {what}: {', '.join(bad)}{more}; fix {'it' if num_bad == 1 else 'them'}: each line "
            'must be one complete JSON object, e.g. {"text": "..."}'
        ) from None


def _check_record_size(size: int, source: str) -> None:
    if size > MAX_RECORD_BYTES:
        raise DataFormatError(f"{source}: the record is {size / 2**20:.1f} MiB, over the {MAX_RECORD_BYTES // 2**20} "
                              "MiB one record may hold (jaxft.data.sources.MAX_RECORD_BYTES); split or shorten it")


def _text_bytes(value: Any) -> int:
    """The UTF-8 bytes of the strings in a record's value (what tokenizing costs memory for)."""
    if isinstance(value, str):
        return len(value.encode("utf-8", errors="replace")) if len(value) * 4 > MAX_RECORD_BYTES else len(value)
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_bytes(v) for v in value)
    return 8


def _parse_line(raw: bytes, *, first: bool) -> tuple[dict | None, str | None]:
    """(object, None) for a good line, (None, None) for a blank one, (None, "col C (why)") for a bad one.

    Columns are 1-based characters of the line, as editors count them.
    """
    try:
        # A UTF-8 byte-order mark (Windows editors write one) is not part of the first object.
        # The line ending is not part of the object either: an unterminated string then points at
        # the opening quote instead of at the newline.
        line = raw.decode("utf-8-sig" if first else "utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
        col = len(raw[: e.start].decode("utf-8", errors="replace")) + 1
        return None, f"col {col} (not valid UTF-8; re-encode the file as UTF-8)"
    if not line.strip():
        return None, None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        # json ends some messages with "at" (the position): "Unterminated string starting at".
        why = e.msg[: -len(" at")] + " here" if e.msg.endswith(" at") else e.msg
        return None, f"col {e.colno} ({why})"
    if not isinstance(obj, dict):
        return None, f"(a JSON {type(obj).__name__}, not an object)"
    return obj, None


def _first_line_is_object(text: str) -> bool:
    for line in text.splitlines():
        if line.strip():
            try:
                return isinstance(json.loads(line), dict)
            except json.JSONDecodeError:
                return False
    return False


def _read_json(file: Path) -> Iterator[Record]:
    try:
        text = file.read_text(encoding="utf-8-sig")  # -sig: a leading byte-order mark is not JSON
    except UnicodeDecodeError:
        raise DataFormatError(f"{file}: not valid UTF-8; re-encode the file as UTF-8") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        # datasets' to_json writes JSON Lines under a .json name: read it line by line
        # (which also gives file:line errors for its bad lines).
        if _first_line_is_object(text):
            yield from _read_jsonl(file)
            return
        raise DataFormatError(
            f"{file}: not valid JSON: line {e.lineno} col {e.colno} ({e.msg}); fix the file: "
            "it must be a JSON array of objects, or JSON Lines (one object per line)"
        ) from None
    if isinstance(obj, dict) and isinstance(obj.get("data"), list):
        obj = obj["data"]
    if not isinstance(obj, list):
        keys = f" with keys {sorted(obj)}" if isinstance(obj, dict) else ""
        raise DataFormatError(
            f"{file}: top level is a JSON {type(obj).__name__}{keys}; expected an array of "
            'records or {"data": [...]}; fix the file or convert it to JSON Lines'
        )
    for i, item in enumerate(obj):
        if not isinstance(item, dict):
            raise DataFormatError(
                f"{file} (record {i}): is a JSON {type(item).__name__}, expected an object; "
                "fix the record"
            )
        _check_record_size(_text_bytes(item), f"{file} (record {i})")
        yield Record(item, f"{file} (record {i})")


def _record_batches_to_records(file: Path, batches: Iterator[pa.RecordBatch]) -> Iterator[Record]:
    row = 0
    try:
        for batch in batches:
            for item in batch.to_pylist():
                _check_record_size(_text_bytes(item), f"{file} (row {row})")
                yield Record(item, f"{file} (row {row})")
                row += 1
    except (pa.ArrowException, OSError) as e:
        raise DataFormatError(
            f"{file} (row {row}): unreadable data ({one_line(e)}); regenerate the file"
        ) from None


def _read_parquet(file: Path) -> Iterator[Record]:
    try:
        pf = pq.ParquetFile(file)
    except (pa.ArrowException, OSError) as e:
        raise DataFormatError(f"{file}: not a readable Parquet file ({one_line(e)}); regenerate it") from None
    yield from _record_batches_to_records(file, pf.iter_batches(batch_size=1024))


def _read_arrow(file: Path) -> Iterator[Record]:
    # datasets writes Arrow IPC *streams*; accept IPC *files* (Feather v2) as well.
    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(file)))
        batches = iter(reader)
    except (pa.ArrowException, OSError):
        try:
            f = pa.ipc.open_file(pa.memory_map(str(file)))
        except (pa.ArrowException, OSError) as e:
            raise DataFormatError(
                f"{file}: not an Arrow IPC stream or file ({one_line(e)}); regenerate it "
                "(e.g. with datasets' save_to_disk)"
            ) from None
        batches = (f.get_batch(i) for i in range(f.num_record_batches))
    yield from _record_batches_to_records(file, batches)
