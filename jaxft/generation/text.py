"""Strings and chats in, completions out: prompt rendering and stop tokens around `generate_ids`.

Prompts tokenize as in training (`jaxft.data.formatting.Formatter`): a plain string gets the tokenizer's
special tokens (BOS where the tokenizer adds one), a chat is rendered by the tokenizer's chat template (which
writes its own BOS) with `add_generation_prompt=True` and tokenized without adding special tokens again.

A chat's messages may hold image parts (`{"type": "image", "image": "path.png"}`, the training data's record
format) for a vision-language model: `encode_prompt_images` renders the chat, expands each image pad token
into one per merged patch and runs the model directory's image processor (`jaxft.data.images`, as in
training), giving the ids and the `PromptImages` the engine prefills with.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from typing import Any, Iterable, Sequence

from jaxft.data.errors import one_line
from jaxft.data.images import ImageProcessor, image_parts
from jaxft.generation.engine import GenerationError, PromptImages, generate_ids, model_stop_ids
from jaxft.models.decoder import Decoder

Chat = list[dict[str, Any]]


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def normalize_prompts(prompts: str | Chat | Sequence[str | Chat]) -> list[str | Chat]:
    """A single string or conversation becomes a list of one; anything else must be a list of those."""
    if isinstance(prompts, str) or _is_chat(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise GenerationError("prompts must be a string, a chat (list of {role, content} dicts) or a non-empty "
                              f"list of those, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if not (isinstance(p, str) or _is_chat(p)):
            raise GenerationError(f"prompts[{i}] must be a string or a list of {{role, content}} dicts, "
                                  f"got {type(p).__name__}")
    return list(prompts)


def encode_prompt(tokenizer, prompt: str | Chat, *, wrap_strings: bool = False, source: str = "prompt") -> list[int]:
    """Token ids of one prompt. A string is wrapped as one user turn when `wrap_strings` and the tokenizer has
    a chat template (else tokenized as text); a chat always needs the template. `source` names it in errors."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, str) and not (wrap_strings and has_template):
        return list(tokenizer(prompt)["input_ids"])
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not has_template:
        raise GenerationError(f"{source}: a chat prompt needs a chat template, but tokenizer "
                              f"{getattr(tokenizer, 'name_or_path', '')!r} has none; give a plain string prompt "
                              "or add chat_template.jinja to the model directory")
    for j, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or "content" not in m:
            raise GenerationError(f"{source}: message {j} needs a string 'role' and a 'content' "
                                  f"(keys: {sorted(m)}); fix the message")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2 errors, raise_exception() in the template, ...
        raise GenerationError(f"{source}: the chat template failed on this conversation ({one_line(e)}); fix "
                              "the messages (roles and order the template expects)") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_prompt_images(tokenizer, prompt: str | Chat, image_processor: ImageProcessor | None, *,
                         wrap_strings: bool = False, source: str = "prompt", base: str | Path | None = None,
                         relative_to: str = "the working directory") -> tuple[list[int], PromptImages | None]:
    """(token ids, PromptImages or None) of one prompt: `encode_prompt`, then, when the chat has image parts,
    each image pad token repeated once per merged patch of its image and the images' pixels from
    `image_processor` (the model directory's, `jaxft.data.ImageProcessor.from_model_dir`). Image paths are
    relative to `base` (default: the working directory; `relative_to` says which in errors)."""
    ids = encode_prompt(tokenizer, prompt, wrap_strings=wrap_strings, source=source)
    if isinstance(prompt, str) or not image_parts(prompt):
        return ids, None
    if image_processor is None:
        raise GenerationError(f"{source}: the chat has image parts but the model has no image processor (no "
                              "vision tower, or none given); use a vision-language model (e.g. Qwen2-VL) with its "
                              "preprocessor_config.json, or drop the image parts")
    refs = image_processor.resolve(source, prompt, base=Path.cwd() if base is None else base,
                                   relative_to=relative_to)
    tokens, _ = image_processor.expand(np.asarray(ids), np.zeros(len(ids), bool), refs, source)
    pixels, grids = image_processor.process(refs)
    return tokens.tolist(), PromptImages(pixels, grids)


def stop_ids(model: Decoder, tokenizer=None, model_dir: str | Path | None = None,
             extra: Iterable[int] | None = None) -> list[int]:
    """Every id that ends a completion: the tokenizer's eos, config.json's eos id(s), generation_config.json's
    (e.g. Llama-3 instruct stops on `<|eot_id|>` as well as `<|end_of_text|>`) and `extra`.

    generation_config.json is read from `model_dir`, else from the tokenizer's directory."""
    ids = set(model_stop_ids(model))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    where = model_dir if model_dir is not None else getattr(tokenizer, "name_or_path", None)
    gen_file = Path(where) / "generation_config.json" if where else None
    if gen_file is not None and gen_file.is_file():
        try:
            eos = json.loads(gen_file.read_text()).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise GenerationError(f"{gen_file}: not valid JSON ({e}); fix or delete the file") from None
        ids.update(int(t) for t in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    ids.update(int(t) for t in extra or ())
    return sorted(ids)


def generate(model: Decoder, tokenizer, prompts: str | Chat | Sequence[str | Chat], *, max_new_tokens: int = 128,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             stop_token_ids: Iterable[int] | None = None, chat_template: bool = False,
             image_processor: ImageProcessor | None = None, truncate_prompt: bool = False) -> list[str]:
    """The completion of each prompt (a string, or a chat rendered with the tokenizer's chat template and the
    generation prompt), decoded without special tokens and without the stop token that ended it.

    Generation stops on the eos ids of the tokenizer, config.json and generation_config.json and on
    `stop_token_ids`. `chat_template=True` wraps plain strings as one user turn. Chats may hold image parts
    (paths relative to the working directory) when `image_processor` is the vision-language model's
    (`jaxft.data.ImageProcessor.from_model_dir(model_dir)`). A prompt longer than the model's context less
    `max_new_tokens` is refused, or with `truncate_prompt` cut to its last tokens that fit. See `generate_ids`.
    """
    items = normalize_prompts(prompts)
    encoded = [encode_prompt_images(tokenizer, p, image_processor, wrap_strings=chat_template,
                                    source=f"prompts[{i}]") for i, p in enumerate(items)]
    stops = stop_ids(model, tokenizer, extra=stop_token_ids)
    images = [im for _, im in encoded]
    out = generate_ids(model, [ids for ids, _ in encoded], max_new_tokens=max_new_tokens, temperature=temperature,
                       top_p=top_p, seed=seed, stop_token_ids=stops,
                       images=images if any(im is not None for im in images) else None,
                       truncate_prompt=truncate_prompt)
    return [decode_completion(tokenizer, row, stops) for row in out]


def decode_completion(tokenizer, ids: list[int], stops: Iterable[int]) -> str:
    """Text of generated ids, without the final stop token and without special tokens."""
    if ids and ids[-1] in set(stops):
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=True)
