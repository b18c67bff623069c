"""Grouped matrix multiply: rows of ``lhs`` sorted by group, each group times its own ``rhs[g]`` (MoE experts).

Public API: grouped_matmul(lhs, rhs, group_sizes, *, implementation="xla"), grouped_matmul_reference(...).
"""

from .api import IMPLEMENTATIONS, OP, grouped_matmul
from .reference import grouped_matmul_reference

__all__ = ["IMPLEMENTATIONS", "OP", "grouped_matmul", "grouped_matmul_reference"]
