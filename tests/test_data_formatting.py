"""Tokenizing records: which tokens are trained, for chat / prompt-completion / text, and errors.

Oracle: the tokenizer itself (`apply_chat_template(tokenize=True)` for the token ids, and
`decode` of the trained tokens against the reply text the template renders).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_data_common import CHATML, CHATML_GENERATION, CHATML_THINK, INST, chat, make_tokenizer

from jaxft.data import (
    ChatTemplateError,
    DataConfigError,
    DataPathError,
    Document,
    Formatter,
    MissingFieldError,
    Record,
    TokenizerError,
    load_tokenizer,
    record_kind,
)

CONV = chat("hello world", "the quick brown fox", "what is two plus two ?", "it is four .")
REPLIES = ["the quick brown fox", "it is four ."]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("tokenizers")


@pytest.fixture(scope="module")
def chatml(root):
    return make_tokenizer(root)[0]


def trained_runs(tok, doc: Document) -> list[str]:
    """Decoded text of each maximal run of trained tokens."""
    m = np.concatenate([[False], doc.loss_mask, [False]]).astype(int)
    starts, ends = np.flatnonzero(np.diff(m) == 1), np.flatnonzero(np.diff(m) == -1)
    return [tok.decode(doc.tokens[s:e]) for s, e in zip(starts, ends)]


def template_ids(tok, messages) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])


@pytest.mark.parametrize(
    "template, style, eos, expected",
    [
        (CHATML, "bytelevel", "<|im_end|>", [r + "<|im_end|>" for r in REPLIES]),
        (CHATML_GENERATION, "bytelevel", "<|im_end|>", [r + "<|im_end|>" for r in REPLIES]),
        # History rewritten: first reply found by search, the last keeps its think block.
        (CHATML_THINK, "bytelevel", "<|im_end|>",
         [REPLIES[0] + "<|im_end|>", "<think>\n\n</think>\n\n" + REPLIES[1] + "<|im_end|>"]),
        # Reply follows "[/INST]" after a space: the space belongs to what the model emits.
        (INST, "bytelevel", "</s>", [" " + r + " </s>" for r in REPLIES]),
        (INST, "metaspace", "</s>", [r + " </s>" for r in REPLIES]),
    ],
    ids=["chatml", "generation-tags", "rewrites-history", "inst-bytelevel", "inst-metaspace"],
)
def test_chat_trains_exactly_the_replies(root, template, style, eos, expected):
    tok, _ = make_tokenizer(root, chat_template=template, style=style, eos=eos)
    doc = Formatter(tok)(Record(CONV, "conv.jsonl:1"))
    assert doc.tokens.dtype == np.int32 and doc.loss_mask.dtype == bool
    assert doc.tokens.tolist() == template_ids(tok, CONV["messages"])
    assert trained_runs(tok, doc) == expected
    assert doc.source == "conv.jsonl:1"


def test_chat_replies_that_repeat_the_prompt_text(chatml):
    # The reply text also occurs in the user turn: spans come from the template, not a search.
    rec = chat("four", "four", "four", "four")
    doc = Formatter(chatml)(Record(rec, "r"))
    assert trained_runs(chatml, doc) == ["four<|im_end|>", "four<|im_end|>"]


def test_chat_with_system_prompt_and_every_token_trained(chatml):
    msgs = [{"role": "system", "content": "answer question"}] + CONV["messages"]
    doc = Formatter(chatml)(Record({"messages": msgs}, "r"))
    assert trained_runs(chatml, doc) == [r + "<|im_end|>" for r in REPLIES]
    everything = Formatter(chatml, assistant_only_loss=False)(Record({"messages": msgs}, "r"))
    assert everything.tokens.tolist() == template_ids(chatml, msgs)
    assert everything.loss_mask.all()


def test_chat_without_assistant_reply_has_no_trained_tokens(chatml):
    doc = Formatter(chatml)(Record({"messages": [{"role": "user", "content": "hello"}]}, "r"))
    assert len(doc) > 0 and doc.num_targets == 0


def test_prompt_completion_trains_completion_and_eos(chatml):
    rec = Record({"prompt": "what is two plus two ?", "completion": " it is four ."}, "r")
    doc = Formatter(chatml)(rec)
    ids = doc.tokens.tolist()
    prompt_ids = chatml("what is two plus two ?")["input_ids"]  # with the BOS the tokenizer adds
    assert ids[: len(prompt_ids)] == prompt_ids and ids[0] == chatml.bos_token_id
    assert ids[-1] == chatml.eos_token_id
    assert not doc.loss_mask[: len(prompt_ids)].any() and doc.loss_mask[len(prompt_ids):].all()
    assert trained_runs(chatml, doc) == [" it is four .<|im_end|>"]
    assert Formatter(chatml, completion_only_loss=False)(rec).loss_mask.all()


def test_conversational_prompt_completion_trains_only_completion_turns(chatml):
    msgs = CONV["messages"]
    rec = Record({"prompt": msgs[:3], "completion": msgs[3:]}, "r")
    doc = Formatter(chatml)(rec)
    assert doc.tokens.tolist() == template_ids(chatml, msgs)
    assert trained_runs(chatml, doc) == [REPLIES[1] + "<|im_end|>"]  # the few-shot reply is context


@pytest.mark.parametrize("add_bos", [True, False])
def test_text_trains_everything_with_bos_and_eos(root, add_bos):
    tok, _ = make_tokenizer(root, add_bos=add_bos)
    doc = Formatter(tok)(Record({"text": "the lazy dog"}, "r"))
    body = tok("the lazy dog", add_special_tokens=False)["input_ids"]
    assert doc.tokens.tolist() == ([tok.bos_token_id] if add_bos else []) + body + [tok.eos_token_id]
    assert doc.loss_mask.all()
    assert Formatter(tok)(Record({"text": "  "}, "r")).num_targets == 0


def test_record_kind_ignores_none_columns():
    # A Parquet row of a chat in a file that also has a text column.
    assert record_kind(Record({"text": None, "messages": CONV["messages"]}, "r")) == "chat"
    assert record_kind(Record({"text": "x", "prompt": None, "completion": None}, "r")) == "text"


# ---- errors ----------------------------------------------------------------------------


def test_no_chat_template_error(root):
    tok, _ = make_tokenizer(root, chat_template=None)
    with pytest.raises(ChatTemplateError) as e:
        Formatter(tok)(Record(CONV, "data.jsonl:7"))
    msg = str(e.value)
    assert msg.startswith("data.jsonl:7: chat record but tokenizer")
    assert '"chat_template" in tokenizer_config.json' in msg and "prompt/completion records" in msg
    # prompt/completion and text records still work without a template.
    assert Formatter(tok)(Record({"prompt": "a", "completion": "b"}, "r")).num_targets == 2


@pytest.mark.parametrize(
    "data, pattern",
    [
        ({"question": "q", "answer": "a"}, r"^f:3: record has keys \['answer', 'question'\] but none of "
         r"the supported fields; use 'messages'.*'prompt' \+ 'completion', or 'text'"),
        ({"prompt": "q"}, r"^f:3: record has 'prompt' but no 'completion'; add a 'completion' field"),
        ({"completion": "a"}, r"^f:3: record has 'completion' but no 'prompt'"),
        ({"messages": "hi"}, r"^f:3: key 'messages' must be a non-empty list .* got str"),
        ({"messages": []}, r"^f:3: key 'messages' must be a non-empty list .* got an empty list"),
        ({"messages": [{"role": "user", "content": "a"}, {"content": "b"}]},
         r"^f:3: messages\[1\] has no string 'role' \(keys: \['content'\]\)"),
        ({"messages": [{"role": "user"}]}, r"^f:3: messages\[0\] \(role 'user'\) has no 'content'"),
        ({"text": 5}, r"^f:3: key 'text' must be a string, got int"),
        ({"prompt": "q", "completion": ["a"]}, r"^f:3: key 'completion' must be a string"),
    ],
)
def test_missing_or_bad_fields(chatml, data, pattern):
    with pytest.raises(MissingFieldError, match=pattern) as e:
        Formatter(chatml)(Record(data, "f:3"))
    assert e.value.__cause__ is None


def test_template_that_rejects_the_conversation(root):
    strict = (
        "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "{{ m.role }}: {{ m.content }}\n{% endfor %}"
    )
    tok, _ = make_tokenizer(root, chat_template=strict)
    bad = {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}
    with pytest.raises(ChatTemplateError, match=r"^f:9: the chat template of .* failed on this "
                       r"conversation \(.*roles must alternate user/assistant\); fix the messages") as e:
        Formatter(tok)(Record(bad, "f:9"))
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_template_that_rewrites_replies(root):
    upper = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | upper }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok, _ = make_tokenizer(root, chat_template=upper)
    # Prefix rendering delimits the reply as rendered, whatever the template does to it ...
    doc = Formatter(tok)(Record(chat("hi", "fine thanks"), "r"))
    assert trained_runs(tok, doc) == ["FINE THANKS<|im_end|>"]
    # ... but a reply rewritten only in history can neither be delimited nor found.
    history_upper = upper.replace("m.content | upper", "m.content | upper if not loop.last else m.content")
    tok, _ = make_tokenizer(root, chat_template=history_upper)
    with pytest.raises(ChatTemplateError, match=r"^f:4: cannot find assistant message 1 "
                       r"\(messages\[1\]\.content\) in the text .* \{% generation %\}"):
        Formatter(tok)(Record(chat("hi", "fine thanks", "and you", "good"), "f:4"))


def test_bad_options_and_tokenizer_paths(tmp_path, chatml):
    with pytest.raises(DataConfigError, match="completion_only_loss must be true or false, got 'yes'"):
        Formatter(chatml, completion_only_loss="yes")
    with pytest.raises(DataPathError, match="does not exist; fix the model path"):
        load_tokenizer(tmp_path / "no_model")
    (tmp_path / "empty_model").mkdir()
    with pytest.raises(TokenizerError, match=r"cannot load a tokenizer from .*empty_model.*tokenizer.json"):
        load_tokenizer(tmp_path / "empty_model")


def test_load_tokenizer_round_trip(root):
    tok, model_dir = make_tokenizer(root)
    loaded = load_tokenizer(model_dir)
    assert loaded.chat_template == CHATML and loaded("hello")["input_ids"] == tok("hello")["input_ids"]
