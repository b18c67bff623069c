"""RMSNorm (transformers semantics) with a memory-lean custom VJP.

Public API: rmsnorm(x, weight, eps, *, implementation="xla"), rmsnorm_reference(x, weight, eps).
"""

from .api import IMPLEMENTATIONS, OP, rmsnorm
from .reference import rmsnorm_reference

__all__ = ["IMPLEMENTATIONS", "OP", "rmsnorm", "rmsnorm_reference"]
