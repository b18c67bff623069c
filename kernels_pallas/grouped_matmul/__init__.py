"""Grouped matrix multiply: rows of ``lhs`` sorted by group, each group times its own ``rhs[g]`` (MoE experts).

Public API: grouped_matmul(lhs, rhs, group_sizes, *, implementation="auto", row=None, lora=None) (row: rhs is a
layer stack, its row read in place; lora: an expert adapter's product added in the kernel),
grouped_matmul_reference(...),
implementation_for(implementation, dtype) (the name that call runs), IMPLEMENTATIONS (every accepted name).
"""

from .api import IMPLEMENTATIONS, OP, grouped_matmul, implementation_for
from .reference import grouped_matmul_reference

__all__ = ["IMPLEMENTATIONS", "OP", "grouped_matmul", "grouped_matmul_reference", "implementation_for"]
