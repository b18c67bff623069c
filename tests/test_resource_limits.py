"""Inputs that would exhaust memory are refused with one line before they are expanded: an oversized data
record, a YAML alias bomb in a config file or override, an image of too many pixels."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from jaxft.data.errors import DataFormatError
from jaxft.data.sources import MAX_RECORD_BYTES, read_records
from jaxft.train import TrainConfigError
from jaxft.train.config_file import load_config, parse_value

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_record_over_the_size_limit_is_refused(tmp_path, suffix):
    big = {"messages": [{"role": "user", "content": "x" * (MAX_RECORD_BYTES + 1)},
                        {"role": "assistant", "content": "ok"}]}
    small = {"text": "fine"}
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        path.write_text(json.dumps(small) + "\n" + json.dumps(big) + "\n")
        where = f"{path}:2"
    else:
        path.write_text(json.dumps([small, big]))
        where = f"{path} (record 1)"
    with pytest.raises(DataFormatError, match=rf"^{__import__('re').escape(where)}: the record is 16\.0 MiB, over the "
                                              r"16 MiB one record may hold") as e:
        read_records(path)
    assert "\n" not in str(e.value)


def _bomb(levels: int = 4) -> list[str]:
    """A YAML alias chain expanding to 10**levels scalars in `levels + 1` lines."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    return lines


@pytest.mark.parametrize("key, wrap", [("lora_target_modules", "[{}]"), ("compiler_options", "{{a: {}}}"),
                                       ("mesh", "{{data: {}}}")])
def test_yaml_alias_bombs_are_refused_with_the_key_and_line(tmp_path, key, wrap):
    bomb = _bomb()
    path = tmp_path / "bomb.yaml"
    value = wrap.format(", ".join([f"*l{len(bomb) - 1}"] * 10))
    path.write_text("\n".join(["model_name_or_path: m", "dataset: d.jsonl", *bomb, f"{key}: {value}"]) + "\n")
    start = time.monotonic()
    with pytest.raises(TrainConfigError, match=r"expands to [\d,]+ values through aliases") as e:
        load_config(path)
    assert time.monotonic() - start < 5 and len(str(e.value)) < 400 and "\n" not in str(e.value)
    assert f"{path}:{len(bomb) + 3}: key {key!r}" in str(e.value)


def test_an_alias_bomb_in_an_override_is_refused():
    value = "[&a [x, x, x, x, x, x, x, x, x, x], &b [" + ", ".join(["*a"] * 10) + "], &c [" + ", ".join(["*b"] * 10)
    value += "], &d [" + ", ".join(["*c"] * 10) + "], &e [" + ", ".join(["*d"] * 10) + "], [" + ", ".join(["*e"] * 10)
    value += "]]"
    with pytest.raises(TrainConfigError, match=r"command line: override value .*expands to [\d,]+ values"):
        parse_value(value)
    assert parse_value("[&a [1, 2], *a]") == [[1, 2], [1, 2]]  # an alias of modest size is still YAML


def test_an_image_of_too_many_pixels_is_refused_before_decoding(tmp_path):
    from PIL import Image

    from jaxft.data import ImageError, ImageProcessor

    Image.new("1", (12000, 12000)).save(tmp_path / "huge.png")  # 144 megapixels, a few KB on disk
    images = ImageProcessor.from_model_dir(EXAMPLES / "tiny-qwen2-vl")
    messages = [{"role": "user", "content": [{"type": "image", "image": "huge.png"}, {"type": "text", "text": "?"}]}]
    with pytest.raises(ImageError, match=r"huge\.png' is 12000x12000 \(144 megapixels\), over the 64 megapixels"):
        images.resolve(f"{tmp_path / 'data.jsonl'}:1", messages)
