"""TRL's loss keys, each acting on its own data format: `assistant_only_loss` on chats, `completion_only_loss`
on prompt/completion records; plain text always trains every token. The oracle for chats is transformers'
`return_assistant_tokens_mask` on a template that marks replies with {% generation %}."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from test_data_common import CHATML_GENERATION, chat, make_tokenizer, write_jsonl

from jaxft.data import DataConfig, Formatter, Record, build_datasets, read_records

CONV = chat("hello", "world how are you", "what is two plus two ?", "it is four .")
PROMPT, COMPLETION = "what is two plus two ?", " it is four ."
FLAGS = list(itertools.product([True, False], repeat=2))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"), chat_template=CHATML_GENERATION)[0]


def _hf_chat(tok, messages):
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), np.array(out["assistant_masks"], bool)


@pytest.mark.parametrize("assistant_only_loss, completion_only_loss", FLAGS)
def test_each_key_acts_on_its_own_format(tok, assistant_only_loss, completion_only_loss):
    fmt = Formatter(tok, assistant_only_loss=assistant_only_loss, completion_only_loss=completion_only_loss)

    ids, replies = _hf_chat(tok, CONV["messages"])
    doc = fmt(Record(CONV, "chat"))
    assert doc.tokens.tolist() == ids
    assert (doc.loss_mask == (replies if assistant_only_loss else np.ones(len(ids), bool))).all()

    doc = fmt(Record({"prompt": PROMPT, "completion": COMPLETION}, "pc"))
    n_prompt = len(tok(PROMPT)["input_ids"])  # with the BOS the tokenizer adds
    assert doc.tokens.tolist() == tok(PROMPT)["input_ids"] + tok(COMPLETION, add_special_tokens=False)[
        "input_ids"] + [tok.eos_token_id]
    expected = np.arange(len(doc)) >= n_prompt if completion_only_loss else np.ones(len(doc), bool)
    assert (doc.loss_mask == expected).all()

    # Conversational prompt/completion: the assistant turns of the completion, or every token.
    msgs = CONV["messages"]
    doc = fmt(Record({"prompt": msgs[:3], "completion": msgs[3:]}, "cpc"))
    n_context = len(tok.apply_chat_template(msgs[:3], tokenize=True, add_generation_prompt=True,
                                            return_dict=True)["input_ids"])
    assert doc.tokens.tolist() == ids
    expected = replies & (np.arange(len(ids)) >= n_context) if completion_only_loss else np.ones(len(ids), bool)
    assert expected.any() and (doc.loss_mask == expected).all()

    doc = fmt(Record({"text": "hello world"}, "text"))
    assert doc.loss_mask.all()


@pytest.mark.parametrize("assistant_only_loss, completion_only_loss", FLAGS)
def test_data_config_passes_both_keys(tmp_path, tok, assistant_only_loss, completion_only_loss):
    rows = [CONV, {"prompt": PROMPT, "completion": COMPLETION}, {"text": "hello world"}]
    f = write_jsonl(tmp_path / "mixed.jsonl", rows)
    cfg = DataConfig(str(f), 64, 1, assistant_only_loss=assistant_only_loss, completion_only_loss=completion_only_loss)
    train, _ = build_datasets(cfg, tok)
    fmt = Formatter(tok, assistant_only_loss=assistant_only_loss, completion_only_loss=completion_only_loss)
    docs = [fmt(r) for r in read_records(f)]
    assert train.stats.trained_tokens == sum(d.num_targets for d in docs)
    chat_doc, pc_doc, text_doc = docs
    assert chat_doc.loss_mask[1:].all() == (not assistant_only_loss)
    assert pc_doc.loss_mask[1:].all() == (not completion_only_loss)
    assert text_doc.loss_mask.all()


def test_defaults_train_replies_and_completions(tok):
    fmt = Formatter(tok)
    assert (fmt.assistant_only_loss, fmt.completion_only_loss) == (True, True)
    cfg = DataConfig("d.jsonl", 32, 1)
    assert (cfg.assistant_only_loss, cfg.completion_only_loss) == (True, True)
    ids, replies = _hf_chat(tok, CONV["messages"])
    assert (fmt(Record(CONV, "c")).loss_mask == replies).all()
