"""Gated linear unit activations with memory-lean custom VJPs.

Public API: swiglu(gate, up, *, implementation="xla"), swiglu_reference(gate, up), and the same for GeGLU
(tanh gelu): geglu_tanh, geglu_tanh_reference; GPT-OSS's clamped SwiGLU of interleaved gate/up columns:
clamped_swiglu(gate_up, limit, alpha), clamped_swiglu_reference.
"""

from .api import CLAMPED_OP, GEGLU_OP, IMPLEMENTATIONS, OP, clamped_swiglu, geglu_tanh, swiglu
from .clamped import clamped_swiglu_reference
from .geglu import geglu_tanh_reference
from .reference import swiglu_reference

__all__ = ["CLAMPED_OP", "GEGLU_OP", "IMPLEMENTATIONS", "OP", "clamped_swiglu", "clamped_swiglu_reference",
           "geglu_tanh", "geglu_tanh_reference", "swiglu", "swiglu_reference"]
