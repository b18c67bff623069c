"""Cross-entropy of a linear head without materialising [tokens, vocab] logits.

Public API:
  linear_cross_entropy(hidden [N, H], weight [H, V], targets [N], weights [N],
                       *, logit_softcap=None, chunk_size=None,
                       implementation="xla") -> fp32 scalar sum_i w_i * CE_i
  linear_cross_entropy_reference(...)   naive full-logits definition
  OP   the op's implementations ("xla", "reference"; kernels_pallas._dispatch.Op)
  LinearCrossEntropyConfig, DEFAULT_CONFIG, default_chunk_size, config_for, tiles_for
  max_intermediate_elements, iter_eqns, find_eqns   jaxpr memory checks
  transposed_copies   transposes of a [V, H] table in a compiled program
"""

from .api import IMPLEMENTATIONS, OP, linear_cross_entropy
from .config import DEFAULT_CONFIG, LinearCrossEntropyConfig, config_for, default_chunk_size, tiles_for
from .jaxpr_stats import find_eqns, iter_eqns, max_intermediate_elements, transposed_copies
from .reference import linear_cross_entropy_reference

__all__ = [
    "DEFAULT_CONFIG",
    "IMPLEMENTATIONS",
    "LinearCrossEntropyConfig",
    "OP",
    "config_for",
    "default_chunk_size",
    "find_eqns",
    "iter_eqns",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "max_intermediate_elements",
    "tiles_for",
    "transposed_copies",
]
