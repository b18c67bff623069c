"""4-bit (NF4 / FP4, bitsandbytes' blockwise format) weight times activations: y = x dequantize(W)^T.

Public API: nf4_matmul(x, packed, absmax, *, shape, blocksize, quant_type, implementation="xla"),
nf4_matmul_reference(...), dequantize_4bit(...), and the code books in ``codes``.
"""

from .api import IMPLEMENTATIONS, OP, nf4_matmul
from .codes import DYNAMIC, FP4, NF4, QUANT_TYPES, code_4bit
from .reference import dequantize_4bit, nf4_matmul_reference, unpack_nibbles

__all__ = ["DYNAMIC", "FP4", "IMPLEMENTATIONS", "NF4", "OP", "QUANT_TYPES", "code_4bit", "dequantize_4bit",
           "nf4_matmul", "nf4_matmul_reference", "unpack_nibbles"]
