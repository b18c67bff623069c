"""The token data every system of the training benchmark trains on: seeded numpy, the same bytes in every process
(checked by a SHA-256), in jaxft's packed-batch form and in transformers' (labels, position_ids, a VLM row's pixels;
a DPO workload's pairs as TRL's prompt_ids / chosen_ids / rejected_ids). Re-exported by workloads."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Protocol

import numpy as np

from .shapes import ModelShape


class WorkloadSpec(Protocol):
    """What the token data reads of a workload (``workloads.Workload``, which imports this module)."""

    name: str
    seed: int
    shape: ModelShape
    batch: int
    seq_len: int
    packed: bool
    mean_doc_len: int
    image_size: int
    dpo: bool

PACKED_DOC_SIGMA = 1.0  # lognormal sigma of packed document lengths (mean is set per workload)
PACKED_MIN_DOC = 2      # shortest document: one with a single token has no target
IMAGE_TEXT_PREFIX = 16  # text tokens before an image row's <|vision_start|> (a user turn's opening words)


@dataclasses.dataclass(frozen=True)
class TokenData:
    """Host numpy arrays with a leading step axis S (one batch per optimizer step).

    jaxft contract (see CONVENTIONS.md): input_ids, targets (next token, 0 where masked),
    loss_mask (1.0 where the target counts), segment_ids (documents 1..n per row), positions
    (restart at 0 per document); all [S, B, T].
    HF contract: ``labels`` [S, B, T] int64 is input_ids with -100 at every document start (and at
    every image token); HF shifts it inside the loss, so the target of position t is labels[t + 1] =
    targets[t] and the masked ones agree with loss_mask == 0. ``position_ids`` = positions (int64).
    Image rows (vision-language workloads) add, in jaxft's packed-batch form (jaxft.data.packing),
    pixel_values [S, B, P * patch_dim] float32 (the image processor's patches of the row's image) and
    image_grid_thw [S, B, 3] int32; ``hf_images(i)`` gives transformers' flat form of step i.
    Preference rows (DPO workloads, ``prompt_len`` set): row j of a step is one pair laid out whole, as
    `jaxft.data.preference` packs it: document 1 prompt + chosen, document 2 prompt + rejected (the same prompt,
    ``prompt_len`` tokens), each T / 2 tokens, the loss mask on the completions' targets only;
    ``preference_examples(i)`` gives TRL's form of step i.
    """

    input_ids: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    attention_pairs: np.ndarray  # [S] causal within-document (query, key) pairs, summed over rows
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None
    image_token_id: int | None = None
    prompt_len: int | None = None

    def step(self, i: int) -> dict[str, np.ndarray]:
        """The jaxft packed-batch dict of step i."""
        out = {"input_ids": self.input_ids[i], "targets": self.targets[i],
               "loss_mask": self.loss_mask[i], "segment_ids": self.segment_ids[i],
               "positions": self.positions[i]}
        if self.pixel_values is not None:
            out.update(pixel_values=self.pixel_values[i], image_grid_thw=self.image_grid_thw[i])
        return out

    def rows(self, start: int, stop: int) -> "TokenData":
        """Rows start..stop-1 of every step (one data-parallel rank's share of a global batch); attention_pairs
        counted again for those rows."""
        cut = {f.name: getattr(self, f.name)[:, start:stop] for f in dataclasses.fields(self)
               if f.name not in ("attention_pairs", "image_token_id", "prompt_len")
               and getattr(self, f.name) is not None}
        return dataclasses.replace(self, **cut, attention_pairs=causal_pairs(cut["segment_ids"]))

    def hf_images(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(pixel_values [patches of every row, patch_dim] float32, image_grid_thw [rows, 3] int64) of step
        i: what transformers' Qwen2.5-VL processor returns for the batch's images, rows in order."""
        grids = self.image_grid_thw[i].reshape(-1, 3).astype(np.int64)
        dim = self.pixel_values.shape[-1] // int(grids[0].prod())
        return self.pixel_values[i].reshape(-1, dim), grids

    def hf_vision_inputs(self, i: int) -> dict[str, np.ndarray]:
        """The vision keyword arguments of step i for transformers' Qwen2.5-VL forward: `hf_images` and
        mm_token_type_ids [B, T] (1 on image tokens, 0 on text, as its processor returns them). Without
        mm_token_type_ids transformers 5 computes no M-RoPE positions: its text model silently takes 1-D
        positions arange(T), which shift every text token after an image (HF+PEFT and Unsloth once trained the 7B
        rows that way)."""
        pixels, grids = self.hf_images(i)
        return {"pixel_values": pixels, "image_grid_thw": grids,
                "mm_token_type_ids": (self.input_ids[i] == self.image_token_id).astype(np.int64)}

    def image_grids(self, i: int) -> list[tuple[int, int, int]]:
        """The (t, h, w) patch grid of every image of step i ([] for text-only data)."""
        if self.image_grid_thw is None:
            return []
        return [tuple(int(v) for v in g) for g in self.image_grid_thw[i].reshape(-1, 3)]

    def preference_examples(self, i: int) -> list[dict[str, list[int]]]:
        """Step i's pairs as TRL's tokenized preference examples (what its DataCollatorForPreference reads):
        prompt_ids, chosen_ids and rejected_ids, one dict per pair, rows in order."""
        if self.prompt_len is None:
            raise ValueError("preference_examples: this data holds no preference pairs (a DPO workload's does)")
        half, p = self.input_ids.shape[-1] // 2, self.prompt_len
        out = []
        for row in self.input_ids[i]:
            chosen, rejected = row[:half], row[half:]
            if not np.array_equal(chosen[:p], rejected[:p]):
                raise ValueError(f"step {i}: a pair's two sequences do not share their {p}-token prompt")
            out.append({"prompt_ids": chosen[:p].tolist(), "chosen_ids": chosen[p:].tolist(),
                        "rejected_ids": rejected[p:].tolist()})
        return out

    def hf_labels(self) -> np.ndarray:
        labels = self.input_ids.astype(np.int64)
        labels[self.positions == 0] = -100
        if self.image_token_id is not None:
            labels[self.input_ids == self.image_token_id] = -100
        return labels

    @property
    def sha256(self) -> str:
        arrays = [self.input_ids, self.positions, self.loss_mask]
        if self.pixel_values is not None:  # every system must see the same pixels too
            arrays += [self.pixel_values, self.image_grid_thw]
        return _sha256(arrays)

    def stats(self) -> dict[str, Any]:
        starts = int((self.positions == 0).sum())
        out = {"steps": int(self.input_ids.shape[0]), "documents": starts,
               "mean_doc_len": float(self.input_ids.size / starts),
               "loss_tokens_per_step": float(self.loss_mask.sum() / self.input_ids.shape[0]),
               "sha256": self.sha256}
        if self.image_token_id is not None:
            out["image_tokens_per_step"] = float((self.input_ids == self.image_token_id).sum()
                                                 / self.input_ids.shape[0])
            out["patches_per_step"] = float(sum(t * h * w for t, h, w in self.image_grids(0)))
        if self.prompt_len is not None:
            out["prompt_len"] = self.prompt_len
        return out


def _sha256(arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def preference_sha256(batches: list[tuple[np.ndarray, np.ndarray]]) -> str:
    """`TokenData.sha256` of the preference pairs TRL's collator made: one (input_ids, completion_mask) per step,
    each [2B, T] with the B chosen rows first, laid out as jaxft's rows (chosen then rejected, positions restarting,
    the loss mask on the targets that are completion tokens). Equal to the workload's hash exactly when TRL trains
    the same pairs in the same order, untruncated and unpadded."""
    ids, positions, masks = [], [], []
    for input_ids, completion in batches:
        input_ids, completion = np.asarray(input_ids), np.asarray(completion)
        b, t = input_ids.shape[0] // 2, input_ids.shape[1]
        target_mask = np.zeros((2 * b, t), np.float32)
        target_mask[:, :-1] = completion[:, 1:] != 0
        ids.append(np.concatenate([input_ids[:b], input_ids[b:]], axis=1).astype(np.int32))
        masks.append(np.concatenate([target_mask[:b], target_mask[b:]], axis=1))
        positions.append(np.tile(np.concatenate([np.arange(t), np.arange(t)]).astype(np.int32), (b, 1)))
    return _sha256([np.stack(ids), np.stack(positions), np.stack(masks)])


def preference_prompt_len(seq_len: int) -> int:
    """The prompt tokens of each side of a DPO workload's pairs: the first half (module docstring of workloads)."""
    return seq_len // 2


def _doc_lengths(rng: np.random.Generator, seq_len: int, mean: int) -> np.ndarray:
    """Lognormal lengths with the given mean (mu = ln(mean) - sigma^2 / 2), last one cut to fit."""
    mu = np.log(mean) - PACKED_DOC_SIGMA ** 2 / 2
    out: list[int] = []
    total = 0
    while total < seq_len:
        n = int(np.clip(np.rint(rng.lognormal(mu, PACKED_DOC_SIGMA)), PACKED_MIN_DOC, seq_len))
        n = min(n, seq_len - total)
        out.append(n)
        total += n
    return np.asarray(out, dtype=np.int64)


def image_processor(shape: ModelShape):
    """transformers' Qwen2-VL image processor of a vision-language shape, the PIL backend named explicitly:
    every worker then computes the same pixels (the torchvision backend resizes slightly differently), and
    the same class is what jaxft's AutoImageProcessor picks on a host without torchvision."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = {k: v for k, v in shape.processor_config.items() if k not in ("image_processor_type", "processor_class")}
    return Qwen2VLImageProcessorPil(**cfg)


def synthetic_image(rng: np.random.Generator, size: int) -> np.ndarray:
    """A size x size RGB uint8 image of uniform noise (no resize can make two processors agree on noise
    they did not both see: the pixels, not the file, are what every system is given)."""
    return rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)


def text_vocab_below(shape: ModelShape) -> int:
    """Synthetic text ids are drawn below this: the vocabulary, or a VLM's lowest vision special id (an
    image pad id drawn into the text would be read as an image token)."""
    ids = [shape.get(k) for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id",
                                  "video_token_id") if shape.has(k)]
    return min([int(shape.get("vocab_size"))] + [int(i) for i in ids])


def _image_rows(workload: WorkloadSpec, steps: int, input_ids: np.ndarray, loss_mask: np.ndarray):
    """Put one image per row into ``input_ids`` (in place): prefix text, <|vision_start|>, one image pad per
    merged patch, <|vision_end|>, text; mask the targets that are image pads. Returns (pixel_values,
    image_grid_thw) in the jaxft batch form."""
    from PIL import Image

    shape = workload.shape
    proc = image_processor(shape)
    rng = np.random.Generator(np.random.PCG64(workload.seed + 1))
    b = workload.batch
    pixels, grids = [], []
    for i in range(steps):
        for j in range(b):
            out = proc(images=[Image.fromarray(synthetic_image(rng, workload.image_size))], return_tensors="np")
            grid = np.asarray(out["image_grid_thw"][0], np.int64)
            n = int(grid.prod()) // int(proc.merge_size) ** 2
            end = IMAGE_TEXT_PREFIX + n + 2
            if end >= workload.seq_len:
                raise ValueError(f"Workload {workload.name!r}: a {workload.image_size}px image takes {n} tokens; "
                                 f"seq_len={workload.seq_len} must exceed {end}")
            row = input_ids[i, j]
            row[IMAGE_TEXT_PREFIX] = shape.get("vision_start_token_id")
            row[IMAGE_TEXT_PREFIX + 1:end - 1] = shape.get("image_token_id")
            row[end - 1] = shape.get("vision_end_token_id")
            pixels.append(np.asarray(out["pixel_values"], np.float32).reshape(-1))
            grids.append(grid.astype(np.int32))
    image = input_ids == shape.get("image_token_id")
    loss_mask[..., :-1][image[..., 1:]] = 0  # an image pad is an input, never a target
    return (np.stack(pixels).reshape(steps, b, -1), np.stack(grids).reshape(steps, b, 3))


def causal_pairs(segment_ids: np.ndarray) -> np.ndarray:
    """[S] causal within-document (query, key) pairs, diagonal included, summed over the rows of each step of
    segment_ids [S, B, T]: n (n + 1) / 2 per document of n tokens. (kernels_pallas.attention.kept_pairs counts the
    same on device; this module stays free of JAX for the torch workers.)"""
    out = np.zeros(segment_ids.shape[0], np.int64)
    for i, step in enumerate(segment_ids):
        for row in step:
            n = np.bincount(row).astype(np.int64)
            out[i] += int((n * (n + 1) // 2).sum())
    return out


def make_token_data(workload: WorkloadSpec, steps: int) -> TokenData:
    """Deterministic token data for ``steps`` optimizer steps (seeded by the workload name).

    Token ids are uniform over the vocabulary (below a VLM's special ids); the same call gives the same
    bytes in every process, which each worker proves by reporting ``TokenData.sha256`` (pixels included).
    """
    if steps < 1:
        raise ValueError(f"make_token_data: steps={steps} must be >= 1")
    if workload.dpo:
        return _preference_data(workload, steps)
    rng = np.random.Generator(np.random.PCG64(workload.seed))
    s, b, t = steps, workload.batch, workload.seq_len
    vocab = text_vocab_below(workload.shape)
    input_ids = rng.integers(0, vocab, size=(s, b, t), dtype=np.int64).astype(np.int32)
    positions = np.empty((s, b, t), np.int32)
    segment_ids = np.empty((s, b, t), np.int32)
    for i in range(s):
        for j in range(b):
            if workload.packed:
                lengths = _doc_lengths(rng, t, workload.mean_doc_len)
            else:
                lengths = np.asarray([t], np.int64)
            positions[i, j] = np.concatenate([np.arange(n) for n in lengths])
            segment_ids[i, j] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    loss_mask = np.zeros((s, b, t), np.float32)
    loss_mask[..., :-1] = positions[..., 1:] != 0  # no target across a document boundary
    images: dict[str, Any] = {}
    if workload.image_size:
        pixel_values, grid = _image_rows(workload, s, input_ids, loss_mask)
        images = {"pixel_values": pixel_values, "image_grid_thw": grid,
                  "image_token_id": int(workload.shape.get("image_token_id"))}
    targets = np.zeros_like(input_ids)
    targets[..., :-1] = input_ids[..., 1:]
    targets[loss_mask == 0] = 0
    return TokenData(input_ids, targets, loss_mask, segment_ids, positions, causal_pairs(segment_ids), **images)


def _preference_data(workload: WorkloadSpec, steps: int) -> TokenData:
    """A DPO workload's pairs (see TokenData): per pair a uniform random prompt and two completions, each side
    seq_len tokens, in rows of 2 * seq_len."""
    rng = np.random.Generator(np.random.PCG64(workload.seed))
    s, b, t = steps, workload.batch, workload.seq_len
    p = preference_prompt_len(t)
    vocab = text_vocab_below(workload.shape)
    prompt = rng.integers(0, vocab, size=(s, b, p), dtype=np.int64)
    chosen, rejected = (rng.integers(0, vocab, size=(s, b, t - p), dtype=np.int64) for _ in range(2))
    input_ids = np.concatenate([prompt, chosen, prompt, rejected], axis=-1).astype(np.int32)
    one = np.arange(t, dtype=np.int32)
    positions = np.broadcast_to(np.concatenate([one, one]), (s, b, 2 * t)).copy()
    segment_ids = np.broadcast_to(np.repeat(np.array([1, 2], np.int32), t), (s, b, 2 * t)).copy()
    doc_mask = ((one >= p - 1) & (one < t - 1)).astype(np.float32)  # targets p .. t-1: the completion
    loss_mask = np.broadcast_to(np.concatenate([doc_mask, doc_mask]), (s, b, 2 * t)).copy()
    targets = np.zeros_like(input_ids)
    targets[..., :-1] = input_ids[..., 1:]
    targets[loss_mask == 0] = 0
    return TokenData(input_ids, targets, loss_mask, segment_ids, positions, causal_pairs(segment_ids), prompt_len=p)
