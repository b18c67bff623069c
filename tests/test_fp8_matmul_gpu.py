"""The FP8 frozen base on the GPU (compute capability 8.9+: FP8 tensor cores): XLA makes both GEMMs of the op
cuBLASLt FP8 calls (`__cublas$lt$matmul$f8`), whose results track the dequantised bf16 matmul within FP8 error;
the training step of an FP8 base (`load_in_fp8`, `auto` picking the FP8 GEMMs) holds one such call per frozen
linear forward and one per input gradient, and trains like the bf16 base. Compiled with XLA's Triton GEMMs off
(`FAST_COMPILE`): with them on, XLA may make the same f8 dots Triton GEMM fusions on the f8 operands instead
(experiments/fp8_deviceless.py)."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from gpu_helpers import FAST_COMPILE, compile_fast
from kernels_pallas import fp8_matmul as ops
from kernels_pallas.fp8_matmul.shapes import Fp8Shape, make_inputs
from test_train_fixtures import make_jsonl, make_tiny_model

pytestmark = pytest.mark.gpu
F8_GEMM = re.compile(r'custom_call_target="__cublas\$lt\$matmul\$f8"')


def _fp8_device() -> bool:
    return ops.has_fp8_tensor_cores(jax.devices()[0])


def _frob(a, b) -> float:
    a, b = np.asarray(a, np.float32).astype(np.float64), np.asarray(b, np.float32).astype(np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_op_gemms_are_cublaslt_fp8_calls_that_track_the_bf16_matmul():
    if not _fp8_device():
        pytest.skip("needs FP8 tensor cores (compute capability 8.9+)")
    assert ops.OP.resolve("auto").name == "xla_fp8"
    shape = Fp8Shape("gpu", 1000, 1024, 4096, "bfloat16")  # 8B-like proportions; rows no multiple of 16
    x, w, dy = make_inputs(shape)
    q, scale = ops.quantize_rows(w)

    def step(impl):
        def run(a, qq, s, g):
            y, pullback = jax.vjp(lambda b: ops.fp8_matmul(b, qq, s, implementation=impl), a)
            return y, pullback(g)[0]
        return compile_fast(run, x, q, scale, dy)

    fp8, bf16 = step("xla_fp8"), step("xla")
    assert len(F8_GEMM.findall(fp8.as_text())) == 2 and not F8_GEMM.search(bf16.as_text())
    (y, dx), (y_want, dx_want) = fp8(x, q, scale, dy), bf16(x, q, scale, dy)
    assert y.dtype == dx.dtype == x.dtype
    assert _frob(y, y_want) < 0.05 and _frob(dx, dx_want) < 0.05


def test_fp8_base_step_has_an_f8_gemm_per_frozen_matmul_and_trains_like_bf16(tmp_path):
    if not _fp8_device():
        pytest.skip("needs FP8 tensor cores (compute capability 8.9+)")
    from jaxft.run import Run
    from jaxft.train import TrainConfig, read_metrics, train

    make_tiny_model(tmp_path / "model", hidden=256, layers=2)
    make_jsonl(tmp_path / "train.jsonl", 300, seed=1)
    losses = {}
    for base in ("bf16", "fp8"):
        cfg = TrainConfig(model_name_or_path=str(tmp_path / "model"), dataset=str(tmp_path / "train.jsonl"),
                          output_dir=str(tmp_path / base), max_seq_length=512, per_device_train_batch_size=4,
                          max_steps=6, logging_steps=1, save_steps=6, learning_rate=5e-3,
                          lr_scheduler_type="constant", lora_r=8, bf16=True, remat="none", layer_loop="unroll",
                          load_in_fp8=(base == "fp8"), compiler_options=FAST_COMPILE, disable_tqdm=True,
                          report_to="none")
        if base == "fp8":
            run = Run.from_config(cfg, 1)
            rows = np.ones((4, 512), np.int32)
            compiled = run.compile(dict(input_ids=rows, targets=rows, loss_mask=rows.astype(np.float32),
                                        segment_ids=rows, positions=np.tile(np.arange(512, dtype=np.int32), (4, 1))))
            # 2 unrolled layers x 7 frozen linears, forward and input gradient, less the first layer's q/k/v input
            # gradients (they would only reach the frozen embeddings: dead code). XLA's dot merger may make the
            # forward GEMMs that share their input (q/k/v, gate/up) one, so a layer has 4 to 7 forward ones.
            assert 2 * 4 + 7 + 4 <= len(F8_GEMM.findall(compiled.as_text())) <= 2 * 7 + 7 + 4
        train(cfg)
        losses[base] = np.array([r["loss"] for r in read_metrics(tmp_path / base / "metrics.jsonl") if "loss" in r])
    assert len(losses["fp8"]) == 6 and losses["fp8"][-3:].mean() < losses["fp8"][0]
    np.testing.assert_allclose(losses["fp8"], losses["bf16"], rtol=5e-2)
