"""Images in chat records, for vision-language models (Qwen2-VL, Qwen2.5-VL).

A chat message's ``content`` may be a list of parts: ``{"type": "text", "text": "..."}`` and
``{"type": "image", "image": "path.png"}``; an image path is relative to the dataset file that holds the record
(absolute paths are kept). The chat template renders one image pad token per image part (Qwen's
``<|vision_start|><|image_pad|><|vision_end|>``); the pipeline then expands that token into one per merged
patch, as transformers' ``Qwen2VLProcessor`` does in the text: ``t * h * w / merge_size^2`` tokens for an image
of ``image_grid_thw = (t, h, w)`` patches. Image tokens never carry loss (they are inputs, not something the
model should generate), whatever ``assistant_only_loss`` says.

Pixels come from transformers' image processor of the model directory (``AutoImageProcessor``: its
``preprocessor_config.json``; without torchvision that is ``Qwen2VLImageProcessorPil``): resize, normalise and
patchify are its, not re-implemented here. The processor runs once per image: when a batch holding it is
built, so a dataset's pixels are never all in memory at once. While the records are tokenized every image
is only opened and decoded (a missing or unreadable image is reported before training starts, naming the
record), and its grid, hence its token count, comes from its size through transformers' own `smart_resize`
with the processor's settings (patch and merge size, min/max pixels): what the processor's resize computes,
without the resize, normalise and patchify work. The batch builder checks that the processor's grids are
those (`jaxft.data.packing`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from jaxft.data.errors import DataPathError, MissingFieldError, TokenizerError, one_line
from jaxft.data.sources import split_source

# The most pixels an image may have: it is decoded whole before the processor shrinks it to its pixel budget
# (Qwen2-VL: about 12.8 megapixels at most), so a 144-megapixel image costs 430 MB of RGB for nothing; PIL only
# warns below 179 megapixels.
MAX_IMAGE_PIXELS = 64_000_000


class ImageError(DataPathError):
    """An image part whose file is missing or cannot be decoded."""


@dataclasses.dataclass(frozen=True)
class ImageRef:
    """One image of a document: its resolved file and its patch grid (t, h, w) from the processor."""

    path: str
    grid: tuple[int, int, int]
    source: str  # the record and part that named it, for errors

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid
        return t * h * w


def image_parts(messages: Any) -> list[tuple[int, int, str]]:
    """(message index, part index, path) of every image part of a chat, in order."""
    out = []
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image":
                out.append((i, j, part.get("image")))
    return out


class ImageProcessor:
    """transformers' image processor of a model directory plus the facts the token layout needs."""

    def __init__(self, processor, image_token_id: int, name: str = "", *, confine: bool = False):
        self.confine = confine  # `resolve` refuses dataset image paths that leave the dataset file's folder
        self.processor = processor
        self.image_token_id = int(image_token_id)
        self.merge_unit = int(processor.merge_size) ** 2
        self.name = name or type(processor).__name__

    @classmethod
    def from_model_dir(cls, path: str | Path, *, confine: bool = False) -> "ImageProcessor":
        """From ``preprocessor_config.json`` (the processor) and ``config.json`` (``image_token_id``)."""
        p = Path(path).expanduser()
        if not (p / "preprocessor_config.json").is_file():
            raise TokenizerError(
                f"{p}: a vision-language model directory needs preprocessor_config.json (the image processor: "
                "patch_size, merge_size, min/max pixels, mean/std); copy it from the original checkpoint")
        from transformers import AutoImageProcessor  # deferred: importing transformers is slow

        try:
            processor = AutoImageProcessor.from_pretrained(str(p), trust_remote_code=False)
        except Exception as e:  # transformers raises many types
            raise TokenizerError(f"cannot load the image processor of {p} ({one_line(e)}); fix "
                                 "preprocessor_config.json") from None
        config = json.loads((p / "config.json").read_text(encoding="utf-8"))
        if "image_token_id" not in config:
            raise TokenizerError(f"{p / 'config.json'}: key 'image_token_id' is missing; add the id of the image "
                                 "pad token (e.g. <|image_pad|>)")
        return cls(processor, config["image_token_id"], name=str(p), confine=confine)

    @classmethod
    def for_model_dir(cls, path: str | Path, *, confine: bool = False) -> "ImageProcessor | None":
        """The processor of a vision-language model directory (config.json has a vision_config), else None."""
        config = Path(path).expanduser() / "config.json"
        if not config.is_file() or "vision_config" not in json.loads(config.read_text(encoding="utf-8")):
            return None
        return cls.from_model_dir(path, confine=confine)

    @property
    def patch_dim(self) -> int:
        pr = self.processor
        return 3 * int(pr.temporal_patch_size) * int(pr.patch_size) ** 2

    def _open(self, path: str, source: str, relative_to: str = "the dataset file"):
        from PIL import Image  # deferred: Pillow is optional (the `demo` extra), needed for image rows only

        if not Path(path).is_file():
            raise ImageError(f"{source}: image {path!r} does not exist; fix the path (relative paths are relative "
                             f"to {relative_to})")
        try:
            with Image.open(path) as image:  # reads the header only
                width, height = image.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise ImageError(f"{source}: image {path!r} is {width}x{height} ({width * height / 1e6:.0f} "
                                     f"megapixels), over the {MAX_IMAGE_PIXELS / 1e6:.0f} megapixels an image may "
                                     "have (jaxft.data.images.MAX_IMAGE_PIXELS); downscale it")
                image.load()
                return image.convert("RGB")
        except ImageError:
            raise
        except Exception as e:  # PIL raises UnidentifiedImageError, OSError, SyntaxError, ...
            raise ImageError(f"{source}: image {path!r} cannot be read ({one_line(e, 120)}); replace the file or "
                             "drop the image part") from None

    def process(self, refs: list[ImageRef]) -> tuple[np.ndarray, np.ndarray]:
        """(pixel_values [sum of patches, patch_dim] float32, image_grid_thw [len(refs), 3]) of the images."""
        images = [self._open(r.path, r.source) for r in refs]
        out = self.processor(images=images, return_tensors="np")
        return np.asarray(out["pixel_values"], np.float32), np.asarray(out["image_grid_thw"], np.int64)

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """The patch grid (t, h, w) the processor gives a still image of this size: its resize target from
        transformers' `smart_resize` (the function the processor's resize calls) with the processor's settings,
        in patches; one frame (a still image is padded to `temporal_patch_size` frames, one temporal patch)."""
        # deferred: importing transformers is slow
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        pr = self.processor
        patch = int(pr.patch_size)
        if getattr(pr, "do_resize", True):
            size = pr.size
            height, width = smart_resize(height, width, factor=patch * int(pr.merge_size),
                                         min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        return 1, height // patch, width // patch

    def resolve(self, record_source: str, messages: Any, *, base: str | Path | None = None,
                relative_to: str = "the dataset file") -> list[ImageRef]:
        """The image parts of a record's chat with their grids (each image opened and decoded, not processed);
        one clear error naming the record and the part for a part without a path, a missing file or an
        unreadable one. Relative paths are relative to `base` (default: the directory of the record's file); with
        `confine`, a path that leaves `base` (`..`, absolute, a link out of it) is refused."""
        base = Path(split_source(record_source)[0]).parent if base is None else Path(base)
        refs = []
        for i, j, image in image_parts(messages):
            where = f"{record_source}: messages[{i}].content[{j}]"
            if not isinstance(image, str) or not image.strip():
                raise MissingFieldError(f"{where}: an image part needs \"image\": \"path.png\" (a file path), got "
                                        f"{image!r}; fix the record")
            path = Path(image).expanduser()
            path = path if path.is_absolute() else base / path
            if self.confine and not path.resolve().is_relative_to(base.resolve()):
                raise ImageError(f"{where}: image {image!r} is outside the dataset's folder {base} (through '..', an "
                                 "absolute path or a link); move it into that folder, or set "
                                 "image_paths_outside_dataset: true to read it there")
            opened = self._open(str(path), where, relative_to)
            refs.append(ImageRef(str(path), self.grid(*opened.size), where))
        return refs

    def expand(self, tokens: np.ndarray, mask: np.ndarray, refs: list[ImageRef], source: str):
        """(tokens, loss mask) with each image pad token repeated once per merged patch of its image, untrained."""
        at = np.flatnonzero(tokens == self.image_token_id)
        if len(at) != len(refs):
            raise MissingFieldError(
                f"{source}: the chat has {len(refs)} image part(s) but the chat template rendered {len(at)} image "
                f"pad token(s) (id {self.image_token_id}); use a chat template that writes one image pad token per "
                "image part (Qwen2-VL's does)")
        repeats = np.ones(len(tokens), np.int64)
        repeats[at] = [r.num_patches // self.merge_unit for r in refs]
        tokens, mask = np.repeat(tokens, repeats), np.repeat(mask, repeats)
        mask[tokens == self.image_token_id] = False
        return tokens, mask
