"""Gated linear unit activations with memory-lean custom VJPs.

Public API: swiglu(gate, up, *, implementation="xla"), swiglu_reference(gate, up), and the same for GeGLU
(tanh gelu): geglu_tanh, geglu_tanh_reference.
"""

from .api import GEGLU_OP, IMPLEMENTATIONS, OP, geglu_tanh, swiglu
from .geglu import geglu_tanh_reference
from .reference import swiglu_reference

__all__ = ["GEGLU_OP", "IMPLEMENTATIONS", "OP", "geglu_tanh", "geglu_tanh_reference", "swiglu", "swiglu_reference"]
