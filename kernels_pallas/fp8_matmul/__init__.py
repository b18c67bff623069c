"""Frozen FP8 weight times activations: y = x dequantize(q, scale)^T, q float8_e4m3fn [out, in] with a float32
scale per output channel.

Public API: fp8_matmul(x, q, scale, *, implementation="auto") ("xla_fp8": both GEMMs in FP8 on Ada/Hopper,
"xla": dequantise to the compute dtype, "reference"), its registry ``OP``, quantize_rows(...) (the one rounding
rule for weights, activations and gradients), dequantize_fp8(...), fp8_matmul_reference(...); the grouped (MoE
expert) form fp8_grouped_matmul(lhs, q, scale, group_sizes, ...) on block-scaled codes, with its registry
``GROUPED_OP`` and dequantize_blocks(...) (grouped.py).
"""

from .api import IMPLEMENTATIONS, OP, fp8_matmul, has_fp8_tensor_cores
from .fp8 import SCOPE
from .grouped import OP as GROUPED_OP
from .grouped import dequantize_blocks, fp8_grouped_matmul, fp8_grouped_matmul_reference
from .reference import E4M3, E4M3_MAX, dequantize_fp8, fp8_matmul_reference, quantize_rows

__all__ = ["E4M3", "E4M3_MAX", "GROUPED_OP", "IMPLEMENTATIONS", "OP", "SCOPE", "dequantize_blocks", "dequantize_fp8",
           "fp8_grouped_matmul", "fp8_grouped_matmul_reference", "fp8_matmul", "fp8_matmul_reference",
           "has_fp8_tensor_cores", "quantize_rows"]
