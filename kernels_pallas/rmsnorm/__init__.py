"""RMSNorm (transformers semantics) with a memory-lean custom VJP.

Public API: rmsnorm(x, weight, eps, *, implementation="xla", offset=False), rmsnorm_reference(x, weight, eps),
rmsnorm_offset_reference(x, weight, eps) (Gemma's (1 + w) form).
"""

from .api import IMPLEMENTATIONS, OFFSET_OP, OP, rmsnorm
from .reference import rmsnorm_offset_reference, rmsnorm_reference

__all__ = ["IMPLEMENTATIONS", "OFFSET_OP", "OP", "rmsnorm", "rmsnorm_offset_reference", "rmsnorm_reference"]
