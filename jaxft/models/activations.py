"""The gated activations of the MLPs, dense and mixture-of-experts alike: h = act(gate) * up."""

from __future__ import annotations

from typing import Callable

import jax

from kernels_pallas.glu import geglu_tanh, swiglu

# HF `hidden_act` / `hidden_activation` -> the gated activation h = act(gate) * up.
ACTIVATIONS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "silu": swiglu,  # custom VJP: only gate and up are kept for its own backward
    "swish": swiglu,
    "gelu_pytorch_tanh": geglu_tanh,  # the same for GeGLU (gelu_tanh evaluated in fp32, as torch does)
}
