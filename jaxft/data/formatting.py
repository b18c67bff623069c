"""Turn records into token documents with a per-token loss mask.

Record formats (checked in this order; a field whose value is ``None`` counts as absent,
which is how columnar files store rows of another format):

* ``messages``: a chat, a list of ``{"role", "content"}`` objects (optional ``tools``),
  rendered with the tokenizer's chat template.
* ``prompt`` + ``completion``: strings (prompt tokens are context, completion tokens are
  trained, EOS appended), or lists of messages (a conversational prompt/completion: the
  concatenation is rendered as a chat and the assistant turns of ``completion`` are trained).
* ``text``: plain text; every token is trained; BOS as the tokenizer adds it, EOS appended.

What is trained is chosen per format by the two TRL `SFTConfig` flags, each acting on its own format
only (a chat dataset is unaffected by ``completion_only_loss`` and vice versa):

* ``assistant_only_loss`` (chats, default True): the assistant replies; False: every token.
* ``completion_only_loss`` (prompt/completion, default True): the completion (for a conversational
  completion, its assistant turns); False: every token, the prompt too.
* plain text is always trained on every token.

TRL's defaults differ for chats (``assistant_only_loss=False`` there); jaxft defaults to training on
what the model should learn to generate, for every format.

Finding the assistant tokens of a chat, for any template:
  1. If the template marks them with ``{% generation %}``, use the tokenizer's
     ``return_assistant_tokens_mask``.
  2. Otherwise, for assistant message ``i`` render ``messages[:i]`` with the generation
     prompt (text ``B``) and ``messages[:i+1]`` (text ``A``). When ``B`` is a prefix of ``A``
     and ``A`` a prefix of the full rendering, the characters ``[len(B), len(A.rstrip()))``
     are the reply plus its end-of-turn marker (exactly what the model must generate after
     the generation prompt). Templates that rewrite history (e.g. drop earlier reasoning)
     break the prefix property; then the reply content is searched in the full text after
     the previous reply and extended over the template's end-of-turn marker.
  3. The full text is tokenized once with character offsets; a token is trained when its
     characters overlap a reply span (so a token that merges a leading space of the reply
     is trained: it is what the model emits first).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Iterable, Literal

import numpy as np

from bridge.errors import hub_id_hint
from jaxft.data.errors import (
    ChatTemplateError,
    DataConfigError,
    DataPathError,
    MissingFieldError,
    TokenizerError,
    one_line,
)
from jaxft.data.images import image_parts
from jaxft.data.sources import Record

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PROBE_REPLY = "\u2063jaxft-reply\u2063"  # invisible separator: will not occur in a template


@dataclasses.dataclass(frozen=True, eq=False)
class Document:
    """A tokenized example.

    ``loss_mask[i]`` is True when token ``i`` is trained, i.e. the prediction of token
    ``i`` from tokens ``< i`` counts in the loss (``loss_mask[0]`` is never used: nothing
    precedes the first token).
    """

    tokens: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # bool [n]
    source: str
    # The images of a chat with image parts, in the order of their runs of image tokens (`jaxft.data.images`).
    images: tuple = ()

    def __post_init__(self):
        tokens = np.asarray(self.tokens, dtype=np.int32)
        mask = np.asarray(self.loss_mask, dtype=bool)
        if tokens.ndim != 1 or mask.shape != tokens.shape:
            raise ValueError(
                f"{self.source}: tokens {tokens.shape} and loss_mask {mask.shape} must be equal 1-D shapes"
            )
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "loss_mask", mask)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_targets(self) -> int:
        """Trained predictions: trained tokens after the first position."""
        return int(self.loss_mask[1:].sum())


def load_tokenizer(path: str | Path):
    """``transformers.AutoTokenizer.from_pretrained`` on a local model directory (or a GGUF file), with clear
    errors."""
    p = Path(path).expanduser()
    if not p.exists():
        hint = hub_id_hint(path) or "; fix the model path"
        raise DataPathError(f"tokenizer/model directory {str(p)!r} does not exist{hint}")
    from transformers import AutoTokenizer  # deferred: importing transformers is slow

    try:
        if p.suffix.lower() == ".gguf" and p.is_file():  # a GGUF file carries its tokenizer
            return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, trust_remote_code=False)
        return AutoTokenizer.from_pretrained(str(p), trust_remote_code=False)
    except Exception as e:  # transformers raises many types (OSError, ValueError, KeyError, ...)
        raise TokenizerError(
            f"cannot load a tokenizer from {p} ({one_line(e)}); the directory needs "
            "tokenizer.json (or the slow-tokenizer files) and tokenizer_config.json"
        ) from None


def record_kind(record: Record, text_field: str = "text") -> Literal["chat", "prompt_completion", "text"]:
    """Which supported format ``record`` is in (plain text under ``text_field``); raises `MissingFieldError`
    naming its keys."""
    d, src = record.data, record.source
    present = {k for k, v in d.items() if v is not None}
    if "messages" in present:
        return "chat"
    if {"chosen", "rejected"} <= present and "completion" not in present:
        raise MissingFieldError(f"{src}: a preference record (prompt/chosen/rejected) in supervised fine-tuning data; "
                                "set `trainer: dpo` to train on preference pairs (docs/objectives.md)")
    if "prompt" in present or "completion" in present:
        missing = "completion" if "prompt" in present else "prompt"
        if missing not in present:
            raise MissingFieldError(
                f"{src}: record has {'prompt' if missing == 'completion' else 'completion'!r} "
                f"but no {missing!r}; add a {missing!r} field (or use a 'text' or 'messages' record)"
            )
        return "prompt_completion"
    if text_field in present:
        return "text"
    raise MissingFieldError(
        f"{src}: record has keys {sorted(d)} but none of the supported fields; use 'messages' "
        f"(chat: list of {{role, content}}), 'prompt' + 'completion', or {text_field!r} (rename your fields"
        + (")" if text_field != "text" else ", or set dataset_text_field to the field that holds the text)")
    )


class Formatter:
    """Tokenizes records for one tokenizer (caches what it learns about the tokenizer)."""

    def __init__(self, tokenizer, *, assistant_only_loss: bool = True, completion_only_loss: bool = True,
                 images=None, text_field: str = "text"):
        """`images`: a `jaxft.data.images.ImageProcessor` (vision-language models); chats with image parts need
        one. `text_field`: the field of plain-text records (TRL's dataset_text_field)."""
        for key, value in (("assistant_only_loss", assistant_only_loss),
                           ("completion_only_loss", completion_only_loss)):
            if not isinstance(value, bool):
                raise DataConfigError(f"{key} must be true or false, got {value!r}")
        self.tokenizer = tokenizer
        self.assistant_only_loss = assistant_only_loss
        self.completion_only_loss = completion_only_loss
        self.images = images
        self.text_field = text_field
        self._name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        self._specials: tuple[list[int], list[int]] | None = None
        self._end_marker: str | None = None

    # ---- tokenizer facts -------------------------------------------------------
    # Every tokenizer call passes verbose=False: whole documents are tokenized here and cut to
    # max_seq_length by packing, so transformers' "sequence length is longer than the specified
    # maximum sequence length for this model" warning (about the tokenizer's model_max_length)
    # does not apply; packing reports what truncation really does, naming the documents.
    def _encode(self, text: str, special: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"])

    def _bos_eos_added(self) -> tuple[list[int], list[int]]:
        """Token ids the tokenizer puts before / after a text with ``add_special_tokens``."""
        if self._specials is None:
            plain = self._encode("a b")
            full = self._encode("a b", special=True)
            self._specials = ([], [])
            for k in range(len(full) - len(plain) + 1):
                if full[k : k + len(plain)] == plain:
                    self._specials = (full[:k], full[k + len(plain) :])
                    break
        return self._specials

    def _eos_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise TokenizerError(
                f"tokenizer {self._name} has no eos_token; set \"eos_token\" in its tokenizer_config.json"
            )
        return int(eos)

    def _template(self, source: str) -> str:
        tmpl = getattr(self.tokenizer, "chat_template", None)
        if not tmpl:
            raise ChatTemplateError(
                f"{source}: chat record but tokenizer {self._name} has no chat template; set "
                "\"chat_template\" in tokenizer_config.json (or add chat_template.jinja), or use "
                "prompt/completion records"
            )
        return tmpl if isinstance(tmpl, str) else " ".join(map(str, dict(tmpl).values()))

    def _render(self, messages, source: str, *, gen: bool, tools=None) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=gen
            )
        except Exception as e:  # jinja2 TemplateError, ValueError from raise_exception(), ...
            raise ChatTemplateError(
                f"{source}: the chat template of {self._name} failed on this conversation "
                f"({one_line(e)}); fix the messages (roles/order the template "
                "expects) or the template"
            ) from None

    def _turn_end_marker(self, source: str) -> str:
        """Text the template puts after an assistant reply (e.g. ``<|im_end|>``), stripped."""
        if self._end_marker is None:
            probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE_REPLY}]
            try:
                text = self.tokenizer.apply_chat_template(probe, tokenize=False)
            except Exception:
                text = ""
            at = text.find(_PROBE_REPLY)
            self._end_marker = text[at + len(_PROBE_REPLY) :].rstrip() if at >= 0 else ""
        return self._end_marker

    # ---- formats ---------------------------------------------------------------
    def __call__(self, record: Record) -> Document:
        kind = record_kind(record, self.text_field)
        if kind == "chat":
            return self._chat(record, record.data["messages"], first_trained=0, masked=self.assistant_only_loss)
        if kind == "prompt_completion":
            return self._prompt_completion(record)
        return self._text(record)

    def _text(self, record: Record) -> Document:
        text = record.data[self.text_field]
        if not isinstance(text, str):
            raise MissingFieldError(
                f"{record.source}: key {self.text_field!r} must be a string, got {type(text).__name__}; fix the "
                "record"
            )
        bos, added_after = self._bos_eos_added()
        eos = self._eos_id()
        tokens = bos + self._encode(text) + added_after
        if not tokens or tokens[-1] != eos:
            tokens.append(eos)
        mask = np.full(len(tokens), bool(text.strip()))  # whitespace-only text: nothing to learn
        return Document(np.array(tokens), mask, record.source)

    def _prompt_completion(self, record: Record) -> Document:
        prompt, completion = record.data["prompt"], record.data["completion"]
        if isinstance(prompt, list) and isinstance(completion, list):
            return self._chat(record, prompt + completion, first_trained=len(prompt),
                              masked=self.completion_only_loss)
        for key, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, str):
                raise MissingFieldError(
                    f"{record.source}: key {key!r} must be a string (or both prompt and completion "
                    f"lists of messages), got {type(value).__name__}; fix the record"
                )
        bos, _ = self._bos_eos_added()
        context = bos + self._encode(prompt)
        reply = self._encode(completion) + [self._eos_id()]
        mask = np.zeros(len(context) + len(reply), dtype=bool)
        mask[len(context) if self.completion_only_loss else 0 :] = True
        return Document(np.array(context + reply), mask, record.source)

    def _chat(self, record: Record, messages: Any, *, first_trained: int, masked: bool) -> Document:
        """A rendered chat; ``masked``: train the assistant turns from ``messages[first_trained]`` on,
        else every token. Image parts (`jaxft.data.images`) become runs of image tokens."""
        messages = _checked_messages(messages, record.source)
        doc = self._chat_text(record, messages, first_trained=first_trained, masked=masked)
        if not image_parts(messages):
            return doc
        if self.images is None:
            raise MissingFieldError(
                f"{record.source}: the chat has image parts but the model has no vision tower (no image processor); "
                "train a vision-language model (e.g. Qwen2-VL) or drop the image parts")
        refs = self.images.resolve(record.source, messages)
        tokens, mask = self.images.expand(doc.tokens, doc.loss_mask, refs, record.source)
        return Document(tokens, mask, record.source, images=tuple(refs))

    def _chat_text(self, record: Record, messages: Any, *, first_trained: int, masked: bool) -> Document:
        src = record.source
        template = self._template(src)
        tools = record.data.get("tools")
        if masked and _GENERATION_TAG.search(template) and first_trained == 0:
            return self._chat_generation_mask(messages, tools, src)
        full = self._render(messages, src, gen=False, tools=tools)
        if not masked:
            tokens = self._encode(full)
            return Document(np.array(tokens), np.ones(len(tokens), bool), src)
        spans = self._assistant_spans(messages, full, src, tools, first_trained)
        return self._tokenize_spans(full, spans, src)

    def _chat_generation_mask(self, messages, tools, src: str) -> Document:
        try:
            out = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                tokenizer_kwargs={"verbose": False},
            )
        except Exception as e:
            raise ChatTemplateError(
                f"{src}: the chat template of {self._name} failed on this conversation "
                f"({one_line(e)}); fix the messages or the template"
            ) from None
        return Document(np.array(out["input_ids"]), np.array(out["assistant_masks"], bool), src)

    def _assistant_spans(self, messages, full: str, src: str, tools, first_trained: int):
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant" or i < first_trained:
                continue
            span = None
            if i > 0:
                before = self._render(messages[:i], src, gen=True, tools=tools)
                through = self._render(messages[: i + 1], src, gen=False, tools=tools)
                if through.startswith(before) and full.startswith(through) and len(before) >= cursor:
                    span = (len(before), len(through.rstrip()))
            if span is None:
                span = self._search_reply(full, msg, i, cursor, src)
            if span is not None and span[1] > span[0]:
                spans.append(span)
                cursor = span[1]
        return spans

    def _search_reply(self, full: str, msg, i: int, cursor: int, src: str):
        content = msg.get("content")
        if isinstance(content, list):  # multimodal-style parts: the text parts, in order
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str) or not content.strip():
            return None  # e.g. a pure tool call: nothing we can locate safely
        for needle in (content, content.strip()):
            at = full.find(needle, cursor)
            if at >= 0:
                end = at + len(needle)
                marker = self._turn_end_marker(src)
                if marker and full.startswith(marker, end):
                    end += len(marker)
                return at, end
        raise ChatTemplateError(
            f"{src}: cannot find assistant message {i} (messages[{i}].content) in the text the chat "
            f"template of {self._name} renders; the template rewrites replies: wrap the reply in "
            "{% generation %}...{% endgeneration %} in the template, or use prompt/completion records"
        )

    def _tokenize_spans(self, full: str, spans, src: str) -> Document:
        if not getattr(self.tokenizer, "is_fast", False):
            raise TokenizerError(
                f"{src}: locating assistant tokens needs a fast tokenizer (character offsets), but "
                f"{self._name} is a {type(self.tokenizer).__name__}; add a tokenizer.json to the model "
                "directory, or mark replies with {% generation %} in the chat template"
            )
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        # Zero-width tokens count as one character so they are trained iff they sit in a span.
        starts, ends = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)
        mask = np.zeros(len(offsets), dtype=bool)
        for s, e in spans:  # trained iff the token's characters overlap [s, e)
            mask |= (starts < e) & (ends > s)
        return Document(np.array(enc["input_ids"]), mask, src)


def _checked_messages(messages: Any, src: str) -> list[dict]:
    """`messages` as the chat template is given them: each checked (a role, and content that is text), a content
    of text parts only (OpenAI's `[{"type": "text", "text": ...}]`) joined into its string, as transformers'
    multimodal templates join them and a text-only template cannot; a MissingFieldError names the record and
    the message otherwise."""
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else type(messages).__name__
        raise MissingFieldError(
            f"{src}: key 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects, "
            f"got {got}; fix the record"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise MissingFieldError(
                f"{src}: messages[{i}] must be an object with 'role' and 'content', got "
                f"{type(m).__name__}; fix the record"
            )
        if not isinstance(m.get("role"), str):
            raise MissingFieldError(
                f"{src}: messages[{i}] has no string 'role' (keys: {sorted(m)}); add "
                "\"role\": \"user\" | \"assistant\" | \"system\""
            )
        if "content" not in m and not m.get("tool_calls"):
            raise MissingFieldError(
                f"{src}: messages[{i}] (role {m['role']!r}) has no 'content'; add the message text"
            )
    return [_checked_content(m, i, src) for i, m in enumerate(messages)]


# Part types a chat's content may hold: text (joined), and images for a vision-language model (`jaxft.data.images`).
_PART_TYPES = ("text", "image")


def _checked_content(m: dict, i: int, src: str) -> dict:
    """Message `i` with its content a string, or a list of parts that holds an image; refuses any other
    content (an object, a number, null without tool calls), which a template would render as Python text."""
    content = m.get("content")
    if isinstance(content, str) or (content is None and m.get("tool_calls")) or "content" not in m:
        return m
    fix = ('give a string, or a list of {"type": "text", "text": ...} (and {"type": "image", "image": path}) '
           "parts; fix the record")
    if not isinstance(content, list):
        got = "null" if content is None else f"{type(content).__name__} {_json_snippet(content)}"
        raise MissingFieldError(f"{src}: messages[{i}].content (role {m['role']!r}) is {got}; {fix}")
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            what = f"a {type(part).__name__}, not an object"
        elif part.get("type") not in _PART_TYPES:
            what = f"type {part.get('type')!r}"
        elif part["type"] == "text" and not isinstance(part.get("text"), str):
            what = "no string 'text'"
        else:
            continue
        raise MissingFieldError(f"{src}: messages[{i}].content[{j}] has {what}; {fix}")
    if any(part["type"] == "image" for part in content):
        return m
    return {**m, "content": "".join(part["text"] for part in content)}


def _json_snippet(value: Any, limit: int = 60) -> str:
    """`value` as short JSON for an error message."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + " ..."


def tokenize_records(
    records: Iterable[Record], tokenizer, *, assistant_only_loss: bool = True, completion_only_loss: bool = True
) -> list[Document]:
    """Tokenize every record (see the module docstring for formats and masks)."""
    fmt = Formatter(tokenizer, assistant_only_loss=assistant_only_loss, completion_only_loss=completion_only_loss)
    return [fmt(r) for r in records]
