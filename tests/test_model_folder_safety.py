"""A model folder is read only within itself and its values are checked: an index naming a file outside the
folder is refused, NaN or infinite weights are named in a warning."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import bridge
import jaxft
from test_train_fixtures import make_tiny_model


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
