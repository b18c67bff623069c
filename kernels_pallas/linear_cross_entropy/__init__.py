"""Cross-entropy of a linear head without materialising [tokens, vocab] logits.

Public API:
  linear_cross_entropy(hidden [N, H], weight [H, V], targets [N], weights [N],
                       *, logit_softcap=None, chunk_size=None,
                       implementation="xla") -> fp32 scalar sum_i w_i * CE_i
  linear_cross_entropy_reference(...)   naive full-logits definition
  LinearCrossEntropyConfig, DEFAULT_CONFIG, default_chunk_size
  max_intermediate_elements, iter_eqns, find_eqns   jaxpr memory checks
"""

from .api import IMPLEMENTATIONS, linear_cross_entropy
from .config import DEFAULT_CONFIG, LinearCrossEntropyConfig, default_chunk_size
from .jaxpr_stats import find_eqns, iter_eqns, max_intermediate_elements
from .reference import linear_cross_entropy_reference

__all__ = [
    "DEFAULT_CONFIG",
    "IMPLEMENTATIONS",
    "LinearCrossEntropyConfig",
    "default_chunk_size",
    "find_eqns",
    "iter_eqns",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "max_intermediate_elements",
]
