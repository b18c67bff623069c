"""Batched generation of token ids: a compiled prefill and a compiled decode loop per shape bucket.

    prefill (jit):  right-padded prompts [B, P] -> KV cache of P + max_new_tokens slots, first new token
    decode  (jit):  lax.while_loop, one token per row per iteration, until every row has produced a stop
                    token or max_new_tokens tokens; finished rows emit pad (cut on the host)

The two programs are dispatched back to back: the host waits once, for the finished token matrix (never per
token, never between prefill and decode unless timings are asked for). Shapes are bucketed so that repeated
calls reuse the compiled programs: the batch is padded with dummy rows to a power of two and the prompt
length rounded up to a multiple of `PROMPT_BUCKET`. `jax.jit` keeps one compiled program per (graphdef,
bucket, max_new_tokens, number of stop ids, greedy or not); temperature, top_p and the seed are data.

Prompts with images (a vision-language model, Qwen2-VL / Qwen2.5-VL): each prompt's `PromptImages` (the
processor's pixel_values and image_grid_thw; its ids hold one image pad token per merged patch) go into the
prefill, which runs the vision tower once and feeds the decoder `inputs_embeds` with the merged patch
embeddings at the image tokens, with 3-D M-RoPE positions. After the prompt every position is text again:
as transformers' `rope_deltas`, the token in cache slot s of a row turns with position s + delta (all three
axes), delta = max(prompt's 3-D positions) + 1 - prompt length, so decoding continues right after the
largest position the prompt used. The cache slots (and hence the causal mask) stay the plain token index. The
patches of the batch are padded to a multiple of `PATCH_BUCKET` merge units with one padding "image" of
their own (its merged tokens match no image token and are dropped), so prompts with images of similar sizes
reuse one compiled prefill.

Dynamic RoPE (`rope_type="dynamic"`) is data-dependent: as in transformers, theta is recomputed in every
forward call from the largest position of the batch in that call (the prefill's longest prompt, then each
decode step's largest position), while the cached keys keep the rotation they were written with. A prompt
run alone therefore matches transformers exactly; in a batch the longest row sets theta for all rows, as in
transformers' own batched (left-padded) generate.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxft.generation.kv_cache import forward, init_cache
from jaxft.generation.sampling import sample
from jaxft.models.decoder import Decoder
from jaxft.models.vision.model import VisionLanguageModel

logger = logging.getLogger("jaxft.generation")
PROMPT_BUCKET = 64
PATCH_BUCKET = 64  # merge units (spatial_merge_size^2 patches each)


class GenerationError(ValueError):
    """A generation argument or prompt is invalid. The message names it and the fix."""


@dataclasses.dataclass(frozen=True)
class Generation:
    """New token ids per prompt (each ends with its stop token when one was produced) and, when timed,
    the prefill and decode seconds (device-synchronised) and the tokens produced by the decode loop."""

    ids: list[list[int]]
    prefill_s: float | None = None
    decode_s: float | None = None
    decode_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class PromptImages:
    """The images of one prompt as the model directory's image processor gives them: pixel_values [patches,
    patch_dim] and image_grid_thw [images, 3] (t, h, w in patches), in the order of the prompt's image runs."""

    pixel_values: np.ndarray
    image_grid_thw: np.ndarray


def _bucket(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _batch_bucket(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _config_ids(model: Decoder, key: str) -> list[int]:
    value = json.loads(model.config.hf_json).get(key)
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def model_stop_ids(model: Decoder) -> list[int]:
    """The eos id(s) of the model's config.json (what transformers' generate stops on by default)."""
    return _config_ids(model, "eos_token_id")


def _prefill(graphdef, state, input_ids, lengths, key, temperature, top_p, pixel_values=None, image_grid_thw=None,
             *, max_new_tokens: int, greedy: bool):
    model = nnx.merge(graphdef, state)
    b, p = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    real = positions < lengths[:, None]
    cache = init_cache(model, b, p + max_new_tokens)
    if isinstance(model, VisionLanguageModel):
        embeds, rope = model.multimodal_inputs(input_ids, pixel_values, image_grid_thw)  # rope: [3, B, P]
        rope = jnp.where(real[None], rope, 0)
        delta = jnp.max(rope, axis=(0, 2)) + 1 - lengths  # transformers' rope_deltas (0 for text-only rows)
        hidden, cache = forward(model, None, positions, cache, rope_positions=rope, inputs_embeds=embeds)
    else:
        delta = jnp.zeros_like(lengths)
        hidden, cache = forward(model, input_ids, positions, cache, rope_positions=jnp.where(real, positions, 0))
    last = hidden[jnp.arange(b), lengths - 1]  # only the last prompt token's logits are needed
    logits = model.logits(last).astype(jnp.float32)
    return sample(logits, jax.random.fold_in(key, 0), temperature, top_p, greedy=greedy), cache, delta


def _decode(graphdef, state, cache, first, lengths, delta, done, stop_ids, key, temperature, top_p, *,
            max_new_tokens: int, greedy: bool, pad_id: int):
    model = nnx.merge(graphdef, state)
    tokens = jnp.full((first.shape[0], max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)

    def cond(carry):
        i, _, _, done, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, tokens, last, done, cache = carry
        positions = (lengths + i - 1)[:, None]  # token i-1 sits right after the prompt's len + i - 1 tokens
        # Its RoPE position is shifted by the row's M-RoPE delta (0 without images).
        hidden, cache = forward(model, last[:, None], positions, cache, rope_positions=positions + delta[:, None])
        logits = model.logits(hidden[:, 0]).astype(jnp.float32)
        token = sample(logits, jax.random.fold_in(key, i), temperature, top_p, greedy=greedy)
        token = jnp.where(done, pad_id, token)
        done = done | jnp.isin(token, stop_ids)
        return i + 1, tokens.at[:, i].set(token), token, done, cache

    steps, tokens, _, _, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), tokens, first, done, cache))
    return tokens, steps


_STATIC = ("graphdef", "max_new_tokens", "greedy")


@functools.cache
def _programs(donate: bool):
    """The jitted prefill and decode (the cache is donated to the decode loop where the backend can)."""
    prefill = jax.jit(_prefill, static_argnames=_STATIC)
    decode = jax.jit(_decode, static_argnames=(*_STATIC, "pad_id"), donate_argnames=("cache",) if donate else ())
    return prefill, decode


def _check(model, prompt_ids, max_new_tokens, temperature, top_p) -> list[list[int]]:
    if not isinstance(model, Decoder):
        raise GenerationError(f"model must be a jaxft Decoder (jaxft.from_pretrained, or nnx.merge(graphdef, "
                              f"lora, frozen)), got {type(model).__name__}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not temperature >= 0:
        raise GenerationError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if not 0 < top_p <= 1:
        raise GenerationError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(prompt_ids, Sequence) or not prompt_ids:
        raise GenerationError("prompt_ids must be a non-empty list of token id lists")
    vocab = model.config.vocab_size
    out = []
    for i, ids in enumerate(prompt_ids):
        ids = [int(t) for t in ids]
        if not ids:
            raise GenerationError(f"prompt {i} has no tokens; give every prompt at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise GenerationError(f"prompt {i} has token id {bad[0]} outside the model's vocabulary [0, {vocab})")
        out.append(ids)
    return out


def _fit_context(model, prompts: list[list[int]], max_new_tokens: int, truncate: bool, images) -> list[list[int]]:
    """The prompts, each checked to leave `max_new_tokens` positions in the model's context
    (max_position_embeddings): past it the positions were never trained (garbage), and a prompt far past it
    exhausts memory before it fails. A longer prompt is refused in one line naming the lengths, or with
    `truncate` cut to its last tokens that fit (one warning line each; not a prompt with images, whose image
    tokens must stay whole). Dynamic RoPE (`rope_type="dynamic"`) is made to run past it: not checked."""
    if model.config.rope.rope_type == "dynamic":
        return prompts
    context = model.config.max_position_embeddings
    room = context - max_new_tokens
    if room < 1:
        raise GenerationError(f"max_new_tokens {max_new_tokens} leaves no room for a prompt in the model's context "
                              f"of {context} tokens (max_position_embeddings); lower max_new_tokens")
    out = []
    for i, ids in enumerate(prompts):
        if len(ids) > room:
            over = (f"prompt {i} has {len(ids)} tokens; with max_new_tokens {max_new_tokens} that is "
                    f"{len(ids) + max_new_tokens} positions, over the model's context of {context} "
                    "(max_position_embeddings)")
            if not truncate or (images is not None and images[i] is not None):
                fix = ("shorten the prompt or lower max_new_tokens (a prompt with images is not truncated)" if truncate
                       else f"shorten the prompt, lower max_new_tokens, or keep its last {room} tokens "
                            "(truncate_prompt=True; jaxft-generate --truncate)")
                raise GenerationError(f"{over}; {fix}")
            logger.warning("%s: truncated to its last %d tokens", over, room)
            ids = ids[-room:]
        out.append(ids)
    return out


def _batch_images(model, prompts: list[list[int]], images):
    """(pixel_values [patches + pad, patch_dim], image_grid_thw [images + 1, 3]) of the prompts' images, in prompt
    order, padded to a `PATCH_BUCKET` multiple of merge units by one padding image (1, m, pad / m); None, None
    when no prompt has images. Each prompt's image tokens must match its images' merged patches."""
    if images is None or all(im is None for im in images):
        return None, None
    if len(images) != len(prompts):
        raise GenerationError(f"images must hold one entry (PromptImages or None) per prompt: {len(images)} for "
                              f"{len(prompts)} prompts")
    if not isinstance(model, VisionLanguageModel):
        first = next(i for i, im in enumerate(images) if im is not None)
        raise GenerationError(f"prompt {first} has images but this {model.config.model_type} model has no vision "
                              "tower; use a vision-language model (e.g. Qwen2-VL) or drop the image parts")
    v = model.config.vision
    pixels, grids = [], []
    for i, (ids, im) in enumerate(zip(prompts, images)):
        count = sum(t == v.image_token_id for t in ids)
        if im is None:
            if count:
                raise GenerationError(f"prompt {i} holds {count} image tokens (id {v.image_token_id}) but no images; "
                                      "give its images, or build the prompt from messages with image parts")
            continue
        px, grid = np.asarray(im.pixel_values, np.float32), np.asarray(im.image_grid_thw, np.int64).reshape(-1, 3)
        patches = int(np.prod(grid, axis=1).sum())
        if px.ndim != 2 or px.shape != (patches, v.patch_dim):
            raise GenerationError(f"prompt {i}: pixel_values {list(px.shape)} do not fit image_grid_thw "
                                  f"{grid.tolist()} (expected [{patches}, {v.patch_dim}]); use the model "
                                  "directory's image processor")
        if count != patches // v.merge_unit:
            raise GenerationError(f"prompt {i} holds {count} image tokens (id {v.image_token_id}) but its images "
                                  f"give {patches // v.merge_unit} merged patches; expand each image pad token "
                                  "once per merged patch (jaxft.generation.encode_prompt_images does)")
        pixels.append(px)
        grids.append(grid)
    pixels, grids = np.concatenate(pixels), np.concatenate(grids)
    unit, m = v.merge_unit, v.spatial_merge_size
    pad = _bucket(len(pixels) // unit + 1, PATCH_BUCKET) * unit - len(pixels)  # >= one merge unit: a valid grid
    pixels = np.concatenate([pixels, np.zeros((pad, pixels.shape[1]), np.float32)])
    grids = np.concatenate([grids, [[1, m, pad // m]]]).astype(np.int32)
    return jnp.asarray(pixels), jnp.asarray(grids)


def run_generation(model: Decoder, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
                   temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                   stop_token_ids: Iterable[int] | None = None, timed: bool = False,
                   images: Sequence[PromptImages | None] | None = None,
                   truncate_prompt: bool = False) -> Generation:
    """`generate_ids`, plus prefill/decode timings when `timed` (a device sync after each stage)."""
    prompts = _check(model, prompt_ids, max_new_tokens, temperature, top_p)
    prompts = _fit_context(model, prompts, max_new_tokens, truncate_prompt, images)
    stops = model_stop_ids(model) if stop_token_ids is None else [int(t) for t in stop_token_ids]
    pad_ids = _config_ids(model, "pad_token_id")
    pad_id = pad_ids[0] if pad_ids else 0
    n, batch = len(prompts), _batch_bucket(len(prompts))
    pixel_values, image_grid_thw = _batch_images(model, prompts, images)
    lengths = np.ones(batch, np.int32)  # dummy rows: one pad token, done from the start
    lengths[:n] = [len(p) for p in prompts]
    input_ids = np.full((batch, _bucket(int(lengths.max()), PROMPT_BUCKET)), pad_id, np.int32)
    for i, ids in enumerate(prompts):
        input_ids[i, :len(ids)] = ids
    stop_arr = jnp.asarray(stops or [-1], jnp.int32)  # -1 never matches: no stop tokens
    greedy = temperature == 0
    key = jax.random.key(seed)
    temperature_arr, top_p_arr = jnp.float32(temperature if not greedy else 1.0), jnp.float32(top_p)
    lengths_arr = jnp.asarray(lengths)
    graphdef, state = nnx.split(model)
    prefill, decode = _programs(jax.default_backend() != "cpu")
    static = dict(graphdef=graphdef, max_new_tokens=max_new_tokens, greedy=greedy)

    t0 = time.perf_counter()
    first, cache, delta = prefill(state=state, input_ids=jnp.asarray(input_ids), lengths=lengths_arr, key=key,
                                  temperature=temperature_arr, top_p=top_p_arr, pixel_values=pixel_values,
                                  image_grid_thw=image_grid_thw, **static)
    if timed:
        first.block_until_ready()
    t1 = time.perf_counter()
    done = jnp.isin(first, stop_arr) | (jnp.arange(batch) >= n)
    tokens, steps = decode(state=state, cache=cache, first=first, lengths=lengths_arr, delta=delta, done=done,
                           stop_ids=stop_arr, key=key, temperature=temperature_arr, top_p=top_p_arr,
                           pad_id=pad_id, **static)
    tokens = np.asarray(tokens)  # the one wait for the result
    t2 = time.perf_counter()

    stop_set = set(stops)
    out = []
    for row in tokens[:n, :int(steps)].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in stop_set), len(row))
        out.append(row[:cut])
    if not timed:
        return Generation(out)
    return Generation(out, prefill_s=t1 - t0, decode_s=t2 - t1, decode_tokens=sum(len(r) - 1 for r in out))


def generate_ids(model: Decoder, prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 stop_token_ids: Iterable[int] | None = None,
                 images: Sequence[PromptImages | None] | None = None,
                 truncate_prompt: bool = False) -> list[list[int]]:
    """New token ids for each prompt (a list of token ids), in the order given.

    A row stops at the first token in `stop_token_ids` (included in its output, as transformers does) or after
    `max_new_tokens` tokens. `stop_token_ids=None` stops on the eos id(s) of the model's config.json; pass a
    list to choose them exactly (`[]`: never stop early). temperature 0 is greedy; otherwise sampling with
    nucleus `top_p`, reproducible for a given `seed`. `model` may carry LoRA adapters and stacked or unstacked
    layer weights (e.g. `nnx.merge(graphdef, lora, frozen)` of the training loop). `images` (a vision-language
    model): one `PromptImages` or None per prompt, whose ids then hold one image pad token per merged patch
    (`jaxft.generation.encode_prompt_images` builds both from messages with image parts).

    A prompt must leave `max_new_tokens` positions of the model's context (max_position_embeddings): a longer
    one is a GenerationError naming the lengths, or with `truncate_prompt` is cut to its last tokens that fit.
    """
    return run_generation(model, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, seed=seed, stop_token_ids=stop_token_ids, images=images,
                          truncate_prompt=truncate_prompt).ids
