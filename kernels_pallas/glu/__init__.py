"""Gated linear unit activations with memory-lean custom VJPs.

Public API: swiglu(gate, up, *, implementation="xla"), swiglu_reference(gate, up).
"""

from .api import IMPLEMENTATIONS, OP, swiglu
from .reference import swiglu_reference

__all__ = ["IMPLEMENTATIONS", "OP", "swiglu", "swiglu_reference"]
