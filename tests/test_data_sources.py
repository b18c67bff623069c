"""Reading records: every supported on-disk format, and the errors for bad inputs."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_data_common import chat, write_arrow_stream, write_jsonl, write_saved_dataset

from jaxft.data import DataFormatError, DataPathError, read_records
from jaxft.data.errors import DataError

ROWS = [
    {"text": "hello world"},
    chat("what is two plus two ?", "it is four ."),
    {"prompt": "the quick brown", "completion": " fox"},
]
# What a columnar writer stores for mixed rows: every column, None where a row lacks it.
UNION = [{k: r.get(k) for k in ("text", "messages", "prompt", "completion")} for r in ROWS]


def _assert_clean(err: DataError):
    """One clear message: no chained exception is printed under it."""
    assert isinstance(err, ValueError)
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)


def test_jsonl_records_keep_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n" + json.dumps(ROWS[2]) + "\n")
    recs = read_records(f)
    assert [r.data for r in recs] == ROWS
    assert [r.source for r in recs] == [f"{f}:1", f"{f}:3", f"{f}:4"]  # blank line 2 skipped


@pytest.mark.parametrize("wrap", [False, True])
def test_json_array_and_data_object(tmp_path, wrap):
    f = tmp_path / "d.json"
    f.write_text(json.dumps({"data": ROWS} if wrap else ROWS, indent=2))
    recs = read_records(f)
    assert [r.data for r in recs] == ROWS
    assert recs[2].source == f"{f} (record 2)"


def test_json_file_holding_json_lines(tmp_path):
    # datasets' Dataset.to_json writes JSON Lines with a .json name.
    f = write_jsonl(tmp_path / "d.json", ROWS)
    recs = read_records(f)
    assert [r.data for r in recs] == ROWS and recs[1].source == f"{f}:2"


def test_parquet_with_nested_messages(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(UNION), f)
    recs = read_records(f)
    # Columnar storage unions the columns: absent fields come back as None.
    assert recs[1].data["messages"] == ROWS[1]["messages"]
    assert recs[1].data["text"] is None and recs[0].data["text"] == "hello world"
    assert recs[2].source == f"{f} (row 2)"


def test_arrow_ipc_stream_and_file(tmp_path):
    stream = write_arrow_stream(tmp_path / "s.arrow", UNION, chunk=1)
    assert [r.data for r in read_records(stream)] == UNION
    table = pa.Table.from_pylist(UNION)
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    assert [r.data for r in read_records(tmp_path / "f.arrow")] == UNION


def test_saved_dataset_directory_reads_shards_in_state_order(tmp_path):
    shards = [[{"text": f"doc {i}"} for i in range(5)], [{"text": f"doc {i}"} for i in range(5, 8)]]
    d = write_saved_dataset(tmp_path / "ds", shards)
    recs = read_records(d)
    assert [r.data["text"] for r in recs] == [f"doc {i}" for i in range(8)]
    assert recs[6].source == f"{d / 'data-00001-of-00002.arrow'} (row 1)"


def test_dataset_dict_directory_splits(tmp_path):
    root = tmp_path / "dd"
    write_saved_dataset(root / "train", [[{"text": "train a"}, {"text": "train b"}]])
    write_saved_dataset(root / "test", [[{"text": "test a"}]])
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert [r.data["text"] for r in read_records(root)] == ["train a", "train b"]
    assert [r.data["text"] for r in read_records(root, split="test")] == ["test a"]
    with pytest.raises(DataPathError, match=r"no split 'validation' \(splits: train, test\)") as e:
        read_records(root, split="validation")
    _assert_clean(e.value)


def test_plain_directory_reads_supported_files_in_name_order(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", ROWS[1:])
    write_jsonl(tmp_path / "a.jsonl", ROWS[:1])
    (tmp_path / "notes.txt").write_text("ignored")
    assert [r.data for r in read_records(tmp_path)] == ROWS


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    f = write_jsonl(tmp_path / "bad.jsonl", ROWS, raw_lines={2: '{"text": "unterminated}'})
    with pytest.raises(DataFormatError) as e:
        read_records(f)
    msg = str(e.value)
    assert msg.startswith(f"{f}: 1 line is not a valid JSON object: line 2 col 10 (Unterminated string")
    assert "one complete JSON object" in msg
    _assert_clean(e.value)


def test_jsonl_line_that_is_not_an_object(tmp_path):
    f = write_jsonl(tmp_path / "bad.jsonl", ROWS, raw_lines={3: '["a", "list"]'})
    with pytest.raises(DataFormatError, match=rf"^{f}: 1 line is not a valid JSON object: line 3 \(a JSON list, not an object\)"):
        read_records(f)


def test_malformed_json_array_names_line(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text('[\n  {"text": "a"},\n  {"text": "b",,}\n]\n')
    with pytest.raises(DataFormatError, match=rf"^{f}: not valid JSON: line 3 col 16 \(Expecting property name"):
        read_records(f)


def test_json_object_without_records(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"rows": ROWS}))
    with pytest.raises(DataFormatError, match=r"top level is a JSON dict with keys \['rows'\]"):
        read_records(f)


@pytest.mark.parametrize("case", ["missing", "suffix", "empty_dir", "parquet", "arrow", "utf8"])
def test_bad_paths_and_files(tmp_path, case):
    if case == "missing":
        path, err, pattern = tmp_path / "nope.jsonl", DataPathError, r"does not exist; fix the path"
    elif case == "suffix":
        path, err, pattern = tmp_path / "d.csv", DataPathError, r"unsupported file type '\.csv'"
        path.write_text("a,b\n")
    elif case == "empty_dir":
        path, err, pattern = tmp_path / "empty", DataPathError, r"holds no data files"
        path.mkdir()
    elif case == "parquet":
        path, err, pattern = tmp_path / "d.parquet", DataFormatError, r"not a readable Parquet file"
        path.write_bytes(b"not parquet at all")
    elif case == "arrow":
        path, err, pattern = tmp_path / "d.arrow", DataFormatError, r"not an Arrow IPC stream or file"
        path.write_bytes(b"definitely not arrow")
    else:
        path, err, pattern = tmp_path / "d.jsonl", DataFormatError, r"line 2 col 11 \(not valid UTF-8"
        path.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(err, match=pattern) as e:
        read_records(path)
    assert str(path) in str(e.value)
    _assert_clean(e.value)


def test_saved_dataset_with_missing_shard(tmp_path):
    d = write_saved_dataset(tmp_path / "ds", [[{"text": "a"}], [{"text": "b"}]])
    (d / "data-00001-of-00002.arrow").unlink()
    with pytest.raises(DataPathError, match=r"lists data-00001-of-00002.arrow but the file is missing"):
        read_records(d)
