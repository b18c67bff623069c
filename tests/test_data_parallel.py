"""Data parallelism: the same global batch split over 2 devices trains like it does on 1 device.

Runs the CLI in subprocesses, one with two host CPU devices (XLA's
--xla_force_host_platform_device_count), so the sharded step (rows split over a "data" mesh, LoRA,
optimizer state and frozen weights replicated) is exercised without a GPU."""

from __future__ import annotations

import numpy as np

from test_train_fixtures import make_jsonl, make_tiny_model, run_cli_on_host_devices


def _run(tmp, name: str, devices: int, per_device_batch: int) -> list[float]:
    cfg = dict(model_name_or_path=str(tmp / "model"), dataset=str(tmp / "train.jsonl"), output_dir=str(tmp / name),
               max_seq_length=64, per_device_train_batch_size=per_device_batch, max_steps=6, logging_steps=1,
               save_steps=6, learning_rate=5e-3, lr_scheduler_type="constant", lora_r=4, seed=0,
               bf16=False, disable_tqdm=True, report_to="none")  # fp32: only the summation order differs
    rows, _ = run_cli_on_host_devices(cfg, tmp / f"{name}.yaml", devices)
    return [r["loss"] for r in rows]


def test_two_devices_match_one_device(tmp_path):
    make_tiny_model(tmp_path / "model")
    make_jsonl(tmp_path / "train.jsonl", 60, seed=0)
    one = _run(tmp_path, "one", devices=1, per_device_batch=4)
    two = _run(tmp_path, "two", devices=2, per_device_batch=2)  # the same 4 rows per step, split in two
    assert len(one) == len(two) == 6
    assert one[-1] < one[0]  # it trains
    np.testing.assert_allclose(two, one, rtol=1e-4)
