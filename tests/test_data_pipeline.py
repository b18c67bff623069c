"""build_datasets end to end: files -> tokenizer -> packed batches, eval splits, and errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_data_common import chat, make_tokenizer, write_jsonl, write_saved_dataset

from jaxft.data import (
    ChatTemplateError,
    DataConfig,
    DataConfigError,
    DataFormatError,
    DataPathError,
    EmptyDatasetError,
    Formatter,
    MissingFieldError,
    build_datasets,
    read_records,
)

WORDS = "hello world how are you the quick brown fox jumps over lazy dog".split()


def random_chats(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    say = lambda k: " ".join(rng.choice(WORDS, size=k))  # noqa: E731
    return [chat(say(int(rng.integers(1, 6))), say(int(rng.integers(1, 8)))) for _ in range(n)]


@pytest.fixture(scope="module")
def tok_and_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_chat_jsonl_with_held_out_eval(tmp_path, tok_and_dir):
    tok, model_dir = tok_and_dir
    f = write_jsonl(tmp_path / "train.jsonl", random_chats(30))
    cfg = DataConfig(str(f), max_seq_length=64, batch_size=2, eval_fraction=0.2, seed=3)
    train, evalset = build_datasets(cfg, str(model_dir))  # tokenizer loaded from the model dir
    assert (train.stats.num_input, evalset.stats.num_input) == (24, 6)
    assert not evalset.shuffle and evalset.num_batches_per_epoch == len(list(evalset))

    # Every trained target is a reply token: the trained targets of an epoch, decoded per
    # document, are exactly the replies (+ end marker) of all the chats.
    replies = sorted(m["content"] + "<|im_end|>" for c in random_chats(30) for m in c["messages"]
                     if m["role"] == "assistant")
    batches = [train.batch(s) for s in range(train.num_batches_per_epoch)] + list(evalset)
    assert sorted(trained_texts(tok, batches)) == replies
    trained = sum(Formatter(tok)(r).num_targets for r in read_records(f))
    assert train.stats.trained_tokens + evalset.stats.trained_tokens == trained


def trained_texts(tok, batches) -> list[str]:
    out = []
    for b in batches:
        for seg, tgt, lm in zip(b["segment_ids"], b["targets"], b["loss_mask"]):
            for j in np.unique(seg[seg > 0]):
                out.append(tok.decode(tgt[(seg == j) & (lm == 1)]))
    return out


def test_same_config_gives_same_batches(tmp_path, tok_and_dir):
    tok, _ = tok_and_dir
    f = write_jsonl(tmp_path / "train.jsonl", random_chats(20, seed=1))
    cfg = DataConfig(str(f), max_seq_length=48, batch_size=2, eval_fraction=0.25, seed=11)
    (a, ea), (b, eb) = build_datasets(cfg, tok), build_datasets(cfg, tok)
    for step in (0, 3, a.num_batches_per_epoch + 1):
        for k, v in a.batch(step).items():
            np.testing.assert_array_equal(v, b.batch(step)[k])
    np.testing.assert_array_equal(ea.batch(0)["input_ids"], eb.batch(0)["input_ids"])


def test_dataset_dict_splits_and_eval_path(tmp_path, tok_and_dir):
    tok, _ = tok_and_dir
    root = tmp_path / "dd"
    write_saved_dataset(root / "train", [[{"text": "hello world"}] * 3, [{"text": "lazy dog"}] * 2])
    write_saved_dataset(root / "test", [[{"prompt": "how are", "completion": " you"}]])
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    train, evalset = build_datasets(DataConfig(str(root), 16, 4, eval_split="test"), tok)
    assert train.stats.num_documents == 5 and evalset.stats.num_documents == 1
    assert evalset.stats.trained_tokens == len(tok(" you", add_special_tokens=False)["input_ids"]) + 1

    eval_file = write_jsonl(tmp_path / "eval.jsonl", [{"text": "the quick fox"}])
    cfg = DataConfig(str(root / "train"), 16, 4, eval_path=str(eval_file), eval_batch_size=1)
    train, evalset = build_datasets(cfg, tok)
    assert evalset.batch_size == 1 and evalset.stats.num_documents == 1
    assert build_datasets(DataConfig(str(root), 16, 4), tok)[1] is None


def test_every_token_trained_and_drop(tmp_path, tok_and_dir):
    tok, _ = tok_and_dir
    long_reply = " ".join(["the quick brown fox"] * 20)
    f = write_jsonl(tmp_path / "d.jsonl", [chat("hello", "world"), chat("hello", long_reply)])
    train, _ = build_datasets(DataConfig(str(f), 24, 1, assistant_only_loss=False, overlong="drop"), tok)
    assert (train.stats.num_documents, train.stats.dropped) == (1, 1)
    doc = Formatter(tok, assistant_only_loss=False)(read_records(f)[0])
    assert train.stats.trained_tokens == len(doc) - 1  # every next token trained


# ---- errors ----------------------------------------------------------------------------


def test_malformed_jsonl_through_build(tmp_path, tok_and_dir):
    rows = random_chats(5)
    f = write_jsonl(tmp_path / "d.jsonl", rows, raw_lines={4: '{"messages": [}'})
    with pytest.raises(DataFormatError, match=rf"^{f}: 1 line is not a valid JSON object: line 4 col 15 ") as e:
        build_datasets(DataConfig(str(f), 32, 1), tok_and_dir[0])
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_missing_field_through_build_names_the_line(tmp_path, tok_and_dir):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}, {"input": "x", "output": "y"}])
    with pytest.raises(MissingFieldError, match=rf"^{f}:2: record has keys \['input', 'output'\]"):
        build_datasets(DataConfig(str(f), 32, 1), tok_and_dir[0])


def test_no_chat_template_through_build(tmp_path):
    tok, model_dir = make_tokenizer(tmp_path, chat_template=None)
    f = write_jsonl(tmp_path / "d.jsonl", random_chats(2))
    with pytest.raises(ChatTemplateError, match=rf"^{f}:1: chat record but tokenizer {model_dir} has no "
                       r"chat template; set \"chat_template\" in tokenizer_config.json"):
        build_datasets(DataConfig(str(f), 32, 1), str(model_dir))


def test_empty_inputs(tmp_path, tok_and_dir):
    tok = tok_and_dir[0]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(EmptyDatasetError, match=rf"^{empty}: no records found"):
        build_datasets(DataConfig(str(empty), 32, 1), tok)
    only_users = write_jsonl(tmp_path / "u.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(EmptyDatasetError, match=r"^train data: no trainable document left of 1: 1 document has "
                       rf"no target tokens \(e.g. a chat without an assistant reply\) and was skipped: {only_users}:1 "):
        build_datasets(DataConfig(str(only_users), 32, 1), tok)
    two = write_jsonl(tmp_path / "two.jsonl", random_chats(2))
    with pytest.raises(EmptyDatasetError, match=r"eval_fraction=0.9 of 2 documents leaves no training data"):
        build_datasets(DataConfig(str(two), 32, 1, eval_fraction=0.9), tok)


def test_missing_paths(tmp_path, tok_and_dir):
    with pytest.raises(DataPathError, match=r"data path '.*nope.jsonl' does not exist"):
        build_datasets(DataConfig(str(tmp_path / "nope.jsonl"), 32, 1), tok_and_dir[0])
    f = write_jsonl(tmp_path / "d.jsonl", random_chats(2))
    with pytest.raises(DataPathError, match=r"tokenizer/model directory '.*no_model' does not exist"):
        build_datasets(DataConfig(str(f), 32, 1), str(tmp_path / "no_model"))
    cfg = DataConfig(str(f), 32, 1, eval_path=str(tmp_path / "no_eval.jsonl"))
    with pytest.raises(DataPathError, match=r"no_eval.jsonl' does not exist"):
        build_datasets(cfg, tok_and_dir[0])


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(max_seq_length=1), r"DataConfig.max_seq_length must be an int >= 2, got 1"),
        (dict(batch_size=0), r"DataConfig.batch_size must be an int >= 1"),
        (dict(eval_batch_size=0), r"DataConfig.eval_batch_size must be an int >= 1"),
        (dict(eval_fraction=1.0), r"DataConfig.eval_fraction must be in \[0, 1\)"),
        (dict(eval_fraction=0.1, eval_path="x.jsonl"), r"cannot be combined with eval_path"),
        (dict(assistant_only_loss="all"), r"DataConfig.assistant_only_loss must be True or False, got 'all'"),
        (dict(completion_only_loss=None), r"DataConfig.completion_only_loss must be True or False, got None"),
        (dict(overlong="wrap"), r"DataConfig.overlong must be one of \('truncate', 'drop'\)"),
        (dict(path=""), r"data path must be a non-empty string"),
        (dict(seed=-1), r"DataConfig.seed must be a non-negative int"),
    ],
)
def test_config_validation(kwargs, pattern):
    args = dict(path="d.jsonl", max_seq_length=32, batch_size=1) | kwargs
    with pytest.raises(DataConfigError, match=pattern):
        DataConfig(**args)
