"""Chat records with image parts (jaxft.data.images): image tokens, loss mask, packed pixel batches, errors.

The model directory is the committed tiny Qwen2-VL example (examples/tiny-qwen2-vl: its tokenizer, chat template
and transformers' image processor config). Token counts are checked against the image processor's own
`get_number_of_image_patches` and the batch pixels against calling the processor directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jaxft.data import DataConfig, ImageError, ImageProcessor, build_datasets, load_tokenizer
from jaxft.data.errors import MissingFieldError

MODEL = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen2-vl"


@pytest.fixture(scope="module")
def images():
    return ImageProcessor.from_model_dir(MODEL)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


def _picture(path: Path, size: tuple[int, int], seed: int) -> str:
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path.name


def _chat(pictures, question, answer):
    parts = [{"type": "image", "image": p} for p in pictures] + [{"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": parts},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}


SIZES = [(70, 90), (56, 56), (112, 84), (84, 112)]  # (width, height)


def _dataset(tmp_path: Path) -> tuple[Path, list[list[int]]]:
    """Three chats (1 image, 2 images, text only) under tmp_path/d/, pictures in d/pics/; returns the file and
    each record's picture indices (into SIZES)."""
    d = tmp_path / "d"
    names = [f"pics/{_picture(d / 'pics' / f'{i}.png', s, i)}" for i, s in enumerate(SIZES)]
    layout = [[0], [1, 2], []]
    rows = [_chat([names[i] for i in layout[0]], "How many?", "There are three."),
            _chat([names[i] for i in layout[1]], "Which has more?", "The second one."),
            {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there."}]}]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return d / "train.jsonl", layout


def _tokens_per_image(images, size) -> int:
    """transformers' count (the processor's get_number_of_image_patches) over the merge unit."""
    w, h = size
    return images.processor.get_number_of_image_patches(h, w) // images.merge_unit


def test_image_tokens_are_merged_patches_and_carry_no_loss(tmp_path, images, tokenizer):
    path, layout = _dataset(tmp_path)
    from jaxft.data import Formatter, read_records

    fmt = Formatter(tokenizer, images=images)
    docs = [fmt(r) for r in read_records(path)]
    image_id = images.image_token_id
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    for doc, pics in zip(docs, layout):
        assert [im.path for im in doc.images] == [str(path.parent / "pics" / f"{i}.png") for i in pics]
        # Each image is one run of image tokens between <|vision_start|> and <|vision_end|>, as long as the
        # processor's patch count over merge_size^2.
        at = np.flatnonzero(doc.tokens == start)
        assert len(at) == len(pics)
        for s, i in zip(at, pics):
            n = _tokens_per_image(images, SIZES[i])
            assert (doc.tokens[s + 1: s + 1 + n] == image_id).all() and doc.tokens[s + 1 + n] == end
        assert int((doc.tokens == image_id).sum()) == sum(_tokens_per_image(images, SIZES[i]) for i in pics)
        # Loss on the assistant reply (and its end-of-turn marker) only: never on image tokens or the question.
        assert not doc.loss_mask[doc.tokens == image_id].any()
        trained = tokenizer.decode(doc.tokens[doc.loss_mask])
        assert trained.strip() in ("There are three.<|im_end|>", "The second one.<|im_end|>", "Hi there.<|im_end|>")
    # assistant_only_loss=False trains the text, still not the image tokens.
    everything = Formatter(tokenizer, assistant_only_loss=False, images=images)(read_records(path)[1])
    assert everything.loss_mask.sum() == (everything.tokens != image_id).sum()


def test_packed_rows_hold_several_images_in_layout_order(tmp_path, images):
    path, _ = _dataset(tmp_path)
    train, _ = build_datasets(DataConfig(str(path), max_seq_length=256, batch_size=1), MODEL)
    assert train.num_rows == 1 and train.max_row_images == 3
    batch = train.batch(0)
    refs = [im for d in train.row_documents(0) for im in train._images[d]]  # in the row's layout order
    want_pixels, want_grids = images.process(refs)
    assert batch["pixel_values"].shape == (1, want_pixels.size) == (1, train.max_row_patches * images.patch_dim)
    np.testing.assert_array_equal(batch["pixel_values"][0], want_pixels.reshape(-1))
    np.testing.assert_array_equal(batch["image_grid_thw"][0], want_grids.reshape(-1))
    sizes = [SIZES[int(Path(im.path).stem)] for im in refs]
    assert int((batch["input_ids"] == images.image_token_id).sum()) == sum(_tokens_per_image(images, s) for s in sizes)
    assert not batch["loss_mask"][0][batch["targets"][0] == images.image_token_id].any()


def test_flat_images_put_real_patches_first_and_keep_logits(tmp_path, images):
    """The device-side conversion of per-row pixel batches (`flat_images`: real patches first, a padding image
    last), and the model's logits on a two-row padded batch given per row as the training step gives it
    (`model_inputs`: `pixel_rows`, `grid_rows`) equal its logits on each row alone with the processor's unpadded
    pixels."""
    import jax
    import jax.numpy as jnp

    import jaxft
    from jaxft.models.vision.model import flat_images
    from jaxft.train.step import model_inputs

    from jaxft.data import Formatter, read_records
    from jaxft.data.packing import PackedDataset

    path, _ = _dataset(tmp_path)
    docs = [Formatter(load_tokenizer(MODEL), images=images)(r) for r in read_records(path)]
    # Rows too short for both image chats: one row each (the text chat joins one of them, or a row of its own).
    max_seq_length = max(len(docs[0]), len(docs[1])) + 1
    assert len(docs[0]) + len(docs[1]) > max_seq_length
    train = PackedDataset(docs, max_seq_length=max_seq_length, batch_size=3, images=images, shuffle=False)
    batch = train.batch(0)
    rows = train.num_rows
    assert rows >= 2 and (batch["image_grid_thw"][:rows] != 0).any(axis=1).sum() == 2
    model = jaxft.from_pretrained(MODEL, dtype="float32")
    cfg = model.config.vision
    pixels, grids = jax.jit(lambda p, g: flat_images(p, g, cfg))(batch["pixel_values"], batch["image_grid_thw"])
    real = [g for g in batch["image_grid_thw"].reshape(-1, 3) if g.prod()]
    n = int(sum(g.prod() for g in real))
    np.testing.assert_array_equal(np.asarray(grids[: len(real)]), np.asarray(real))
    assert np.asarray(grids[-1]).prod() == pixels.shape[0] - n  # the padding image covers the rest
    args, kw = model_inputs(model, {k: jnp.asarray(v) for k, v in batch.items()})
    assert set(kw) == {"pixel_rows", "grid_rows"}
    got = np.asarray(jax.jit(lambda i, s, kw: model(i, segment_ids=s, **kw))(args[0], args[2], kw))
    forward = jax.jit(lambda i, s, p, g: model(i, segment_ids=s, pixel_values=p, image_grid_thw=g))  # a compile a row
    for r in range(rows):
        refs = [im for d in train.row_documents(train.rows_of(0)[r]) for im in train._images[d]]
        p, g = images.process(refs) if refs else (None, None)
        alone = np.asarray(forward(batch["input_ids"][r:r + 1], batch["segment_ids"][r:r + 1], p, g))
        np.testing.assert_allclose(got[r:r + 1], alone, rtol=1e-5, atol=1e-5)


def test_missing_or_unreadable_image_is_one_line_naming_the_record(tmp_path, images):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "broken.png").write_text("not a png", encoding="utf-8")
    good = _picture(d / "ok.png", (56, 56), 0)
    for name, problem in (("nowhere.png", "does not exist"), ("broken.png", "cannot be read")):
        rows = [_chat([good], "Q?", "A."), _chat([good, name], "Q?", "A.")]
        (d / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        with pytest.raises(ImageError) as info:
            build_datasets(DataConfig(str(d / "data.jsonl"), max_seq_length=128, batch_size=1), MODEL)
        msg = str(info.value)
        assert "\n" not in msg and problem in msg
        assert msg.startswith(f"{d / 'data.jsonl'}:2: messages[0].content[1]: image {str(d / name)!r}")
    rows = [{"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "A."}]}]
    (d / "data.jsonl").write_text(json.dumps(rows[0]) + "\n", encoding="utf-8")
    with pytest.raises(MissingFieldError, match=r"data.jsonl:1: messages\[0\].content\[0\]: an image part needs"):
        build_datasets(DataConfig(str(d / "data.jsonl"), max_seq_length=128, batch_size=1), MODEL)


def test_truncation_never_splits_an_image_from_its_tokens(tmp_path, images):
    from jaxft.data import Formatter, Record
    from jaxft.data.packing import PackedDataset

    names = [_picture(tmp_path / f"{i}.png", SIZES[i], i) for i in (1, 2)]
    turns = _chat([names[0]], "First?", "One.")["messages"] + _chat([names[1]], "Second?", "Two.")["messages"]
    doc = Formatter(load_tokenizer(MODEL), images=images)(Record({"messages": turns}, f"{tmp_path / 'd.jsonl'}:1"))
    first = _tokens_per_image(images, SIZES[1])
    at = np.flatnonzero(doc.tokens == images.image_token_id)
    cut = int(at[first + 2])  # inside the second image's run
    ds = PackedDataset([doc], max_seq_length=cut + 5, batch_size=1, images=images)
    assert ds._images[0] == doc.images[:1] and ds.stats.truncated == 1
    batch = ds.batch(0)
    assert int((batch["input_ids"] == images.image_token_id).sum()) == first
    assert (batch["segment_ids"][0] > 0).sum() == at[first]  # cut where the second image's tokens begin
    np.testing.assert_array_equal(batch["image_grid_thw"][0], np.asarray(doc.images[0].grid))


class _Counting:
    """The model directory's image processor, counting the images it is asked to process."""

    def __init__(self, processor):
        self.processor, self.images = processor, 0

    def __getattr__(self, name):
        return getattr(self.processor, name)

    def __call__(self, images, **kw):
        self.images += len(images)
        return self.processor(images=images, **kw)


def test_each_image_is_processed_once_when_its_batch_is_built(tmp_path, images, tokenizer):
    """Tokenizing only opens the images (their grids come from their sizes); the processor runs once per image,
    for its batch, and the grids it gives are the ones the tokens were laid out for (packing checks them)."""
    path, layout = _dataset(tmp_path)
    counting = _Counting(images.processor)
    train, _ = build_datasets(DataConfig(str(path), max_seq_length=128, batch_size=1), tokenizer,
                              images=ImageProcessor(counting, images.image_token_id))
    assert counting.images == 0
    for step in range(train.num_batches_per_epoch):
        train.batch(step)
    assert counting.images == sum(len(pics) for pics in layout) == 3


@pytest.mark.parametrize("size", [(70, 90), (20, 500), (600, 30), (1000, 800), (28, 28)])
def test_grid_from_the_size_is_the_processors(images, size):
    """The resize target (smart_resize with the processor's min/max pixels) in patches, clamped both ways."""
    w, h = size
    picture = Image.fromarray(np.zeros((h, w, 3), np.uint8))
    want = images.processor(images=[picture], return_tensors="np")["image_grid_thw"][0]
    assert images.grid(w, h) == tuple(int(g) for g in want)
