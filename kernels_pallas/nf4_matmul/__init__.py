"""4-bit (NF4 / FP4, bitsandbytes' blockwise format) weight times activations: y = x dequantize(W)^T.

Public API: nf4_matmul(x, packed, absmax, *, shape, blocksize, quant_type, implementation="xla") ("xla",
"reference"), nf4_matmul_reference(...), dequantize_4bit(...), and the code books in ``codes``; the grouped (MoE expert)
form nf4_grouped_matmul(lhs, packed, absmax, group_sizes, ...) with its registry ``GROUPED_OP`` (grouped.py).
"""

from .api import IMPLEMENTATIONS, OP, nf4_matmul
from .grouped import OP as GROUPED_OP
from .grouped import dequantize_groups, nf4_grouped_matmul, nf4_grouped_matmul_reference
from .codes import DYNAMIC, FP4, NF4, QUANT_TYPES, code_4bit
from .reference import dequantize_4bit, nf4_matmul_reference, unpack_nibbles

__all__ = ["DYNAMIC", "FP4", "GROUPED_OP", "IMPLEMENTATIONS", "NF4", "OP", "QUANT_TYPES", "code_4bit",
           "dequantize_4bit", "dequantize_groups", "nf4_grouped_matmul", "nf4_grouped_matmul_reference", "nf4_matmul",
           "nf4_matmul_reference", "unpack_nibbles"]
