"""Training a vision-language model through the one recipe (`jaxft.train.train` -> `jaxft.run.Run`): chats with
images in, an evaluated run and a PEFT adapter out that transformers' Qwen2-VL class loads with jaxft's logits;
and the Unsloth-named `finetune_*` keys of TrainConfig.

The model is the committed tiny random Qwen2-VL (examples/tiny-qwen2-vl); the data a few records of the example's
generator (scripts/make_vlm_example.py) written to a temporary directory.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from jaxft.train import TrainConfig, TrainConfigError

from scripts.make_vlm_example import make_dataset

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples" / "tiny-qwen2-vl"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("vlm_data")
    make_dataset(out, records=16, eval_records=4, seed=1)
    return out


def _config(data: Path, out: Path, **kw) -> TrainConfig:
    values = dict(model_name_or_path=str(MODEL), dataset=str(data / "train.jsonl"),
                  eval_dataset=str(data / "eval.jsonl"), output_dir=str(out), max_steps=3,
                  per_device_train_batch_size=2, max_seq_length=128, learning_rate=1e-2, warmup_steps=0,
                  logging_steps=1, eval_steps=3, save_steps=3, report_to="none", bf16=False, disable_tqdm=True,
                  lora_r=4, lora_alpha=8, remat="none", seed=0)
    return TrainConfig(**{**values, **kw})


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """One in-process run on 4-row batches (attention adapters of the tower and the decoder): the adapter the
    transformers test loads and the one-device losses the mesh test is held to."""
    from jaxft.train import train

    return train(_config(data, tmp_path_factory.mktemp("vlm_run") / "run", per_device_train_batch_size=4,
                         finetune_mlp_modules=False))


@pytest.mark.slow  # ~1 min on 2 cores, most of it compiling the step (the tower and the decoder)
def test_train_on_images_then_the_adapter_loads_in_transformers_with_equal_logits(data, trained):
    import peft
    import torch
    import transformers
    import jax.numpy as jnp
    from flax import nnx

    import jaxft
    from jaxft.data import Formatter, ImageProcessor, load_tokenizer, read_records
    from jaxft.train.metrics import read_metrics
    from lora_helpers import rel_err
    from test_qwen2_vl import _hf_logits

    result = trained
    evals = [r["eval_loss"] for r in read_metrics(result.metrics_path) if "eval_loss" in r]
    assert len(evals) == 2 and all(math.isfinite(e) for e in evals)  # step 0 and step 3
    assert evals[1] < evals[0]
    adapter = result.adapter_dir
    keys = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert "visual" in str(keys) and "mlp" not in str(keys)  # finetune_mlp_modules: false -> attention only

    images = ImageProcessor.from_model_dir(MODEL)
    record = read_records(data / "eval.jsonl")[3]  # two pictures
    doc = Formatter(load_tokenizer(MODEL), images=images)(record)
    pixels, grids = images.process(list(doc.images))
    ids = doc.tokens[None].astype(np.int64)
    model = jaxft.load_adapter(jaxft.from_pretrained(MODEL, dtype="float32"), adapter)
    # jitted: one program (op by op, every eager op of the tower and the decoder compiles on its own)
    ours = np.asarray(nnx.jit(lambda m, i, p, g: m(i, pixel_values=p, image_grid_thw=g))(
        model, jnp.asarray(ids), jnp.asarray(pixels), jnp.asarray(grids)))
    base = transformers.Qwen2VLForConditionalGeneration.from_pretrained(MODEL, attn_implementation="eager",
                                                                        dtype=torch.float32)
    plain = _hf_logits(base, ids, pixels, grids, images.image_token_id)
    theirs = peft.PeftModel.from_pretrained(base, adapter).eval()
    assert sum("visual.blocks" in n for n, _ in theirs.named_modules() if n.endswith("lora_A")) == 2 * 2
    want = _hf_logits(theirs, ids, pixels, grids, images.image_token_id)
    assert rel_err(ours, want) < 1e-5
    assert rel_err(ours, plain) > 1e-4  # the trained adapter changes the logits


def test_finetune_keys_choose_the_lora_targets(tmp_path, data):
    from jaxft.models.vision import finetune_targets

    cfg = _config(data, tmp_path, finetune_vision_layers=False)
    assert cfg.lora_config.target_modules == finetune_targets("qwen2_vl", finetune_vision_layers=False)
    assert _config(data, tmp_path).lora_config.target_modules == "all-linear"  # none given: lora_target_modules
    from jaxft.run import Run

    names = Run.from_config(_config(data, tmp_path, finetune_language_layers=False,
                                    finetune_attention_modules=False), 1).check_targets()
    assert names and all(n.startswith("model.visual.blocks.") and ".mlp." in n for n in names)


@pytest.mark.parametrize("keys, match", [
    (dict(finetune_vision_layers=False, finetune_language_layers=False),
     r"key 'finetune_language_layers': finetune_vision_layers and finetune_language_layers are both false"),
    (dict(finetune_attention_modules=False, finetune_mlp_modules=False),
     r"key 'finetune_mlp_modules': finetune_attention_modules and finetune_mlp_modules are both false"),
    (dict(finetune_vision_layers=True, lora_target_modules=["q_proj"]),
     r"key 'finetune_vision_layers': .* lora_target_modules is also given"),
])
def test_finetune_keys_errors_are_one_line(tmp_path, data, keys, match):
    with pytest.raises(TrainConfigError, match=match) as info:
        _config(data, tmp_path, **keys)
    assert "\n" not in str(info.value)


def test_finetune_keys_on_a_text_only_model_is_an_error(tmp_path, data):
    from test_train_fixtures import make_tiny_model

    model = make_tiny_model(tmp_path / "llama")
    with pytest.raises(TrainConfigError, match=r"key 'finetune_vision_layers': .* is a text-only model \(model_type "
                                               r"'llama'\)"):
        _config(data, tmp_path, model_name_or_path=str(model), finetune_vision_layers=False)


def _patch_rows(dump: Path, patch_dim: int) -> int:
    """The most patches any [N, patch_dim] array of the compiled training step holds (the tower's input)."""
    step = max(dump.glob("*jit_step*after_optimizations.txt"), key=lambda f: f.stat().st_size)
    return max(int(n) for n in re.findall(rf"f32\[(\d+),{patch_dim}\]", step.read_text()))


@pytest.mark.slow  # jaxft-train on 4 host devices, ~1 min on 2 cores
def test_on_a_mesh_each_device_embeds_its_own_rows_images(data, trained, tmp_path):
    """The module run's 4-row batches on data=2 x fsdp=2 (a row per device) against the module run on one device:
    equal losses, and the mesh's compiled step gives the tower a quarter of the batch's patches (before
    `per_device_images` every device ran the tower on the whole batch's images: 736 patches here, against 184 of
    its own row). The whole batch's patch count is the data pipeline's pixel_values of a batch, as the one-device
    step takes them."""
    from jaxft.data import build_datasets
    from jaxft.train.metrics import read_metrics
    from test_train_fixtures import run_cli_on_host_devices

    config = json.loads((MODEL / "config.json").read_text())["vision_config"]
    patch_dim = config["in_channels"] * config["temporal_patch_size"] * config["patch_size"] ** 2
    values = dict(model_name_or_path=str(MODEL), dataset=str(data / "train.jsonl"), max_steps=3,
                  max_seq_length=128, learning_rate=1e-2, warmup_steps=0, logging_steps=1, save_steps=100,
                  report_to="none", bf16=False, disable_tqdm=True, lora_r=4, lora_alpha=8, remat="none", seed=0,
                  finetune_mlp_modules=False)  # the tower's adapters: their gradients summed over the devices
    mesh, _ = run_cli_on_host_devices({**values, "output_dir": str(tmp_path / "mesh"), "per_device_train_batch_size": 1,
                                       "mesh": {"data": 2, "fsdp": 2}}, tmp_path / "mesh.yaml", 4, timeout=600,
                                      dump_hlo=tmp_path / "hlo_mesh")
    one = [r["loss"] for r in read_metrics(trained.metrics_path) if "loss" in r]
    assert len(one) == len(mesh) == 3
    np.testing.assert_allclose([r["loss"] for r in mesh], one, rtol=1e-5)
    train_set, _ = build_datasets(_config(data, tmp_path / "unused", per_device_train_batch_size=4).data_config(1),
                                  MODEL)
    pixels = train_set.batch(0)["pixel_values"]
    assert pixels.shape[0] == 4
    whole = pixels.size // patch_dim
    assert whole > 0 and _patch_rows(tmp_path / "hlo_mesh", patch_dim) * 4 == whole
