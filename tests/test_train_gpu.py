"""Training on a GPU: bf16 steps with the Pallas attention kernels track the XLA path."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import FAST_COMPILE
from test_train_fixtures import make_jsonl, make_tiny_model

pytestmark = pytest.mark.gpu


def test_pallas_attention_training_tracks_xla(tmp_path):
    from jaxft.train import TrainConfig, read_metrics, train

    make_tiny_model(tmp_path / "model", hidden=256, layers=2)  # head_dim 64: kernel-friendly tiles
    make_jsonl(tmp_path / "train.jsonl", 400, seed=0)
    losses = {}
    for impl in ("xla", "pallas"):
        cfg = TrainConfig(model_name_or_path=str(tmp_path / "model"), dataset=str(tmp_path / "train.jsonl"),
                          output_dir=str(tmp_path / impl), max_seq_length=512, per_device_train_batch_size=4,
                          gradient_accumulation_steps=2, max_steps=8, logging_steps=1, save_steps=8,
                          learning_rate=5e-3, lr_scheduler_type="constant", lora_r=8, bf16=True,
                          attention_implementation=impl, remat="full", compiler_options=FAST_COMPILE,
                          disable_tqdm=True, report_to="none")
        train(cfg)
        losses[impl] = np.array([r["loss"] for r in read_metrics(tmp_path / impl / "metrics.jsonl") if "loss" in r])
    assert len(losses["xla"]) == 8
    assert losses["xla"][-3:].mean() < losses["xla"][0]
    np.testing.assert_allclose(losses["pallas"], losses["xla"], rtol=2e-2)


def test_unrolled_layers_train_like_the_scan(tmp_path):
    """bf16 on the GPU, attention `auto` (cuDNN or Pallas per batch): the unrolled layers over per-layer weight
    buffers (the fast mode's default) train like the layer scan, with and without host-offloaded remat (remat
    changes what is stored, not the math: both unrolled runs are held to the one scan run), and the merged export
    of an unrolled run is written from restacked weights."""
    from jaxft.train import TrainConfig, read_metrics, train

    make_tiny_model(tmp_path / "model", hidden=256, layers=2)  # two layers: an unrolled chain, half the compile
    make_jsonl(tmp_path / "train.jsonl", 300, seed=1)
    losses = {}
    for loop, remat in (("scan", "none"), ("unroll", "none"), ("unroll", "offload")):
        run = f"{loop}_{remat}"
        cfg = TrainConfig(model_name_or_path=str(tmp_path / "model"), dataset=str(tmp_path / "train.jsonl"),
                          output_dir=str(tmp_path / run), max_seq_length=512, per_device_train_batch_size=4,
                          max_steps=6, logging_steps=1, save_steps=6, learning_rate=5e-3,
                          lr_scheduler_type="constant", lora_r=8, bf16=True, attention_implementation="auto",
                          remat=remat, layer_loop=loop, save_merged_model=(run == "unroll_offload"),
                          compiler_options=FAST_COMPILE, disable_tqdm=True, report_to="none")
        train(cfg)
        losses[run] = np.array([r["loss"] for r in read_metrics(tmp_path / run / "metrics.jsonl") if "loss" in r])
    assert len(losses["scan_none"]) == 6 and losses["scan_none"][-3:].mean() < losses["scan_none"][0]
    for run in ("unroll_none", "unroll_offload"):
        np.testing.assert_allclose(losses[run], losses["scan_none"], rtol=2e-2, err_msg=run)
    assert (tmp_path / "unroll_offload" / "merged" / "config.json").exists()
