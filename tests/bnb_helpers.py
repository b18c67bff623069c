"""What the bitsandbytes CPU oracle computes on this machine.

bitsandbytes 0.50.2 on an x86 CPU with AVX512-BF16 (`bitsandbytes.functional.has_avx512bf16()`) registers a fused
CPU kernel for the 4-bit matmul that transformers' `Linear4bit` runs (backends/cpu/ops.py, `gemv_4bit`): it rounds the
activations and the block absmax to bfloat16 before the product, so transformers' float32 logits of a 4-bit model
carry bfloat16 error there (measured: relative logit error 3e-3 to 1.5e-2 against the same weights dequantised,
on a tiny Llama). Elsewhere it dequantises and multiplies in float32, exact to rounding. The stored bytes, and the
dequantised weights, are the same on both; only the oracle's arithmetic differs.
"""

from __future__ import annotations

from pathlib import Path

import bitsandbytes.functional as bnb_functional
import torch
import transformers

BF16_TOL = 2e-2  # relative logit error of a bfloat16 computation (the tests' bf16 tolerance)


def cpu_4bit_logit_tol(float32_tol: float) -> float:
    """The tolerance for float32 logits of transformers' 4-bit forward on this CPU: `float32_tol` where bitsandbytes
    computes in float32, `BF16_TOL` where its fused AVX512-BF16 kernel computes in bfloat16."""
    return BF16_TOL if bnb_functional.has_avx512bf16() else float32_tol


def save_tiny_llama(path: Path, config: dict) -> Path:
    """A float32 Llama of `config` with random weights and norm scales drawn around 1 (so a norm that is skipped or
    applied twice shows), saved with transformers: the base the 4-bit checkpoints are made from."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **config),
                                                          dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    model.save_pretrained(path)
    return path
