"""Folders are read only within themselves and their values are checked: an index naming a file outside the model
folder is refused, NaN or infinite weights are named in a warning, a dataset's image paths stay in its folder."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import bridge
import jaxft
from test_train_fixtures import make_tiny_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("folder") / "model")


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(tmp_path, model_dir, shard):
    d = tmp_path / "model"
    d.mkdir()
    for f in model_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    names = list(load_file(d / "model.safetensors"))
    (d / "model.safetensors").rename(tmp_path / "outside.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in names}}))
    with pytest.raises(bridge.CheckpointError, match=rf"shard {shard!r} .* is not a file of {d}"):
        bridge.checkpoint_files(d)


def test_nan_weights_in_a_base_model_are_named(tmp_path, model_dir, caplog):
    d = tmp_path / "model"
    d.mkdir()
    for f in model_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 4] = np.inf
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="jaxft"):
        jaxft.from_pretrained(d, dtype="float32")
    hits = [r.message for r in caplog.records if "NaN or infinite" in r.message]
    assert len(hits) == 1 and "down_proj" in hits[0] and "1 weight(s)" in hits[0], hits


def test_non_finite_weights_are_named_whether_checked_on_the_host_or_the_device(tmp_path, caplog):
    """Small weights are checked on their host copy, large ones (over 2**20 values) on the device: both named."""
    d = make_tiny_model(tmp_path / "model", vocab=32800)  # the embedding table: 32800 x 32 values
    tensors = load_file(d / "model.safetensors")
    assert tensors["model.embed_tokens.weight"].size > 1 << 20
    tensors["model.embed_tokens.weight"][5, 6] = np.nan
    tensors["model.layers.0.self_attn.q_proj.weight"][0, 0] = -np.inf
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="jaxft"):
        jaxft.from_pretrained(d, dtype="float32")
    hits = [r.message for r in caplog.records if "NaN or infinite" in r.message]
    assert len(hits) == 1 and "2 weight(s)" in hits[0] and "embed.embedding" in hits[0] and "q_proj" in hits[0], hits


def test_dataset_image_paths_stay_in_the_dataset_folder(tmp_path):
    from PIL import Image

    from jaxft.data import ImageError, ImageProcessor

    data, outside = tmp_path / "data", tmp_path / "private"
    data.mkdir()
    outside.mkdir()
    Image.new("RGB", (56, 56)).save(data / "in.png")
    Image.new("RGB", (56, 56)).save(outside / "secret.png")
    (data / "link.png").symlink_to(outside / "secret.png")
    source = f"{data / 'train.jsonl'}:1"

    def chat(path: str):
        return [{"role": "user", "content": [{"type": "image", "image": path}, {"type": "text", "text": "?"}]}]

    confined = ImageProcessor.from_model_dir(EXAMPLES / "tiny-qwen2-vl", confine=True)
    assert len(confined.resolve(source, chat("in.png"))) == 1
    for path in ("../private/secret.png", str(outside / "secret.png"), "link.png"):
        with pytest.raises(ImageError, match=r"is outside the dataset's folder .*image_paths_outside_dataset: true"):
            confined.resolve(source, chat(path))
    free = ImageProcessor.from_model_dir(EXAMPLES / "tiny-qwen2-vl", confine=False)
    assert len(free.resolve(source, chat("../private/secret.png"))) == 1
