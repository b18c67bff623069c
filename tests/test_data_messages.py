"""Data messages a user reads: bad JSON Lines (line and column, many at once), documents cut by
max_seq_length named by file:line, no misleading transformers length warning, and no internal
DataConfig names (seq_len, overlong) on the CLI path."""

from __future__ import annotations

import json
import logging
import re

import pytest
import yaml
from test_data_common import CHATML, CHATML_GENERATION, chat, make_tokenizer, write_jsonl
from test_train_fixtures import make_tiny_model

from jaxft.cli import main
from jaxft.data import DataConfig, DataFormatError, Formatter, Record, build_datasets, load_tokenizer, read_records
from jaxft.data.sources import split_source

INTERNAL = re.compile(r"(?<!max_)seq_len|overlong|data\.")  # names a CLI user cannot set


# ---- malformed JSON Lines --------------------------------------------------------------


def test_many_bad_lines_in_one_message_with_1_based_columns(tmp_path):
    good = [json.dumps({"text": f"row {i}"}) for i in range(20)]
    bad = {
        2: '{"text": "a" "b"}',  # col 14: the second string where a ',' belongs
        4: '{"text": "unterminated}',  # col 10: the opening quote (not the line's newline)
        5: '["a", "list"]',
        7: '  {"text": 1 2}',  # col 14: leading spaces count
    }
    for lineno in range(9, 18):  # 9 more bad lines: 13 in all, 10 of them named
        bad[lineno] = "{"
    lines = [bad.get(i + 1, g) for i, g in enumerate(good)]
    f = tmp_path / "train.jsonl"
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(DataFormatError) as e:
        read_records(f)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(
        f"{f}: 13 lines are not valid JSON objects: line 2 col 14 (Expecting ',' delimiter), "
        "line 4 col 10 (Unterminated string starting here), line 5 (a JSON list, not an object), "
        "line 7 col 14 (Expecting ',' delimiter), line 9 col 2 (Expecting property name"
    ), msg
    assert "line 14 col 2" in msg and "line 15" not in msg  # 10 named, the other 3 counted
    assert msg.endswith(', and 3 more; fix them: each line must be one complete JSON object, e.g. {"text": "..."}')


def test_bad_utf8_column_counts_characters(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes('{"text": "ok"}\n{"text": "é\xff"}\n'.encode("utf-8").replace(b"\xc3\xbf", b"\xff"))
    with pytest.raises(DataFormatError, match=r"1 line is not a valid JSON object: line 2 col 12 \(not valid UTF-8"):
        read_records(f)


def test_byte_order_mark_is_not_an_error(tmp_path):
    rows = [{"text": "a"}, {"text": "b"}]
    jsonl, js = tmp_path / "d.jsonl", tmp_path / "d.json"
    jsonl.write_bytes(b"\xef\xbb\xbf" + "\n".join(map(json.dumps, rows)).encode())
    js.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())
    assert [r.data for r in read_records(jsonl)] == rows
    assert [r.data for r in read_records(js)] == rows


def test_split_source():
    assert split_source("data/t.jsonl:17") == ("data/t.jsonl", ":17")
    assert split_source("d.parquet (row 3)") == ("d.parquet", "row 3")
    assert split_source("d.json (record 0)") == ("d.json", "record 0")
    assert split_source("somewhere") == ("somewhere", "")


# ---- documents cut by max_seq_length ----------------------------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))[0]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "jaxft.data" and r.levelno == logging.WARNING]


def test_truncated_and_cut_documents_are_named(tmp_path, tok, caplog):
    short = {"text": "hello world"}
    long_text = {"text": " ".join(["the quick brown fox"] * 20)}
    long_prompt = {"prompt": " ".join(["hello world"] * 30), "completion": "four"}
    rows = [short, long_text, short, long_text, long_text, long_prompt, long_text, short, long_prompt]
    f = write_jsonl(tmp_path / "train.jsonl", rows)
    n_long = len(Formatter(tok)(Record(long_text, "x")))
    cut_doc = Formatter(tok)(Record(long_prompt, "x"))
    first_target = int(cut_doc.loss_mask[1:].argmax()) + 1
    with caplog.at_level(logging.INFO, logger="jaxft.data"):
        train, _ = build_datasets(DataConfig(str(f), 32, 1), tok)
    assert (train.stats.truncated, train.stats.skipped) == (4, 2)
    truncated, cut = _warnings(caplog)
    assert truncated == (
        f"train data: 4 documents longer than max_seq_length=32 were truncated: {f}:2 ({n_long} tokens), "
        f":4 ({n_long}), :5 ({n_long}), and 1 more; raise max_seq_length to keep them whole"
    )
    assert cut == (
        f"train data: 2 documents have no target tokens left after truncation to max_seq_length=32 and were "
        f"skipped: {f}:6 ({len(cut_doc)} tokens, first target at token {first_target}), :9 ({len(cut_doc)}, "
        f"first target at token {first_target}); raise max_seq_length or shorten the prompts"
    )
    assert not INTERNAL.search(caplog.text), caplog.text


def test_columnar_sources_are_named_by_row(tmp_path, tok, caplog):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": "hi"}, {"text": " ".join(["hello world"] * 30)}]
    f = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), f)
    with caplog.at_level(logging.WARNING, logger="jaxft.data"):
        build_datasets(DataConfig(str(f), 16, 1), tok)
    (warning,) = _warnings(caplog)
    n = len(Formatter(tok)(Record(rows[1], "x")))
    assert f"1 document longer than max_seq_length=16 was truncated: {f} (row 1) ({n} tokens);" in warning


# ---- transformers' model_max_length warning ---------------------------------------------


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("template", [CHATML, CHATML_GENERATION], ids=["spans", "generation_tags"])
def test_no_model_max_length_warning(tmp_path, template):
    # A fresh tokenizer per case: transformers warns once per tokenizer instance.
    tok, _ = make_tokenizer(tmp_path, chat_template=template)
    tok.model_max_length = 8
    long = " ".join(["the quick brown fox"] * 10)
    rows = [{"text": long}, {"prompt": long, "completion": long}, chat(long, long)]
    handler = _Collect()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        docs = [Formatter(tok)(Record(r, f"r{i}")) for i, r in enumerate(rows)]
    finally:
        hf_logger.removeHandler(handler)
    assert all(len(d) > 8 for d in docs)
    assert not [m for m in handler.messages if "Token indices sequence length" in m], handler.messages


# ---- the CLI path -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_data")
    make_tiny_model(d / "model")
    return d


def _config(d, name, dataset, **extra):
    cfg = dict(model_name_or_path=str(d / "model"), dataset=str(dataset), output_dir=str(d / name),
               max_seq_length=24, per_device_train_batch_size=2, max_steps=1, lora_r=2, disable_tqdm=True,
               report_to="none", bf16=False) | extra
    path = d / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def test_cli_names_every_document_with_no_target_left(cli_dir, capsys):
    rows = [{"prompt": "reverse: " + "cat dog " * 6, "completion": "dog cat"}] * 3
    data = write_jsonl(cli_dir / "cut.jsonl", rows)
    assert main([str(_config(cli_dir, "cut", data))]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("jaxft-train: error:")]
    assert "train data: no trainable document left of 3: 3 documents have no target tokens left after " \
           f"truncation to max_seq_length=24 and were skipped: {data}:1 (" in line, line
    assert ":2 (" in line and ":3 (" in line and "raise max_seq_length" in line
    assert not INTERNAL.search(err), err


def test_cli_warns_about_truncation_with_user_keys(cli_dir, capsys):
    rows = [{"text": "cat dog sun."}] * 4 + [{"text": "cat dog sun moon fish bird star tree."}]
    data = write_jsonl(cli_dir / "long.jsonl", rows)
    assert main([str(_config(cli_dir, "long", data))]) == 0
    err = capsys.readouterr().err
    n = len(Formatter(load_tokenizer(cli_dir / "model"))(Record(rows[-1], "x")))
    assert n > 24
    assert f"1 document longer than max_seq_length=24 was truncated: {data}:5 ({n} tokens)" in err, err
    assert "Token indices sequence length" not in err
    assert not INTERNAL.search(err), err
