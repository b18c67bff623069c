"""Flash attention over packed batches (Pallas/Triton kernels, cuDNN, XLA reference).

Public API:
  dot_product_attention(q, k, v, *, segment_ids=None, metadata=None, causal=True,
      sliding_window=None, logit_softcap=None, sinks=None, scale=None,
      implementation="reference") -> [B,T,H,D]
      implementations: OP (kernels_pallas._dispatch.Op): "reference" ("xla" alias),
      "pallas", "cudnn"; "auto"/None picks per call
  make_metadata(segment_ids, *, causal=True, sliding_window=None, block_q=None,
      block_k=None) -> AttentionMetadata
  kept_pairs(segment_ids, window=None) -> int: (query, key) pairs the causal mask keeps
"""

from kernels_pallas.attention.api import IMPLEMENTATIONS, OP, dot_product_attention
from kernels_pallas.attention.metadata import AttentionMetadata, kept_pairs, make_metadata
from kernels_pallas.attention.reference import attention_reference

__all__ = [
    "AttentionMetadata",
    "IMPLEMENTATIONS",
    "OP",
    "attention_reference",
    "dot_product_attention",
    "kept_pairs",
    "make_metadata",
]
