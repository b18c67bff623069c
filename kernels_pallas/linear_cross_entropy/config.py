"""Static configuration of the chunked linear cross-entropy.

The only tuning knob of the XLA implementation is the number of tokens per
chunk ``C``.  Per chunk the forward pass materialises one ``[C, V]`` fp32
logits block (``C * V * 4`` bytes); the backward pass holds about two such
blocks at a time (logits and ``dlogits``).  Larger chunks give larger, more
efficient matmuls and fewer loop iterations; smaller chunks bound memory.
256 MiB per block keeps the matmul of a 128k vocabulary at ~512 tokens,
which already saturates an H100/H200-class GPU, while the peak transient
memory stays around half a GiB regardless of the number of tokens.
"""

from __future__ import annotations

import dataclasses

_MIB = 2**20


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyConfig:
    """How the default chunk size is chosen.

    Attributes:
      logits_chunk_bytes: upper bound for one chunk's fp32 logits block,
        ``chunk_size * vocab_size * 4`` bytes.
      chunk_multiple: the chunk size is rounded down to a multiple of this
        (matmul-friendly tiles) whenever the byte budget allows at least one
        multiple.
    """

    logits_chunk_bytes: int = 256 * _MIB
    chunk_multiple: int = 128

    def __post_init__(self) -> None:
        for name in ("logits_chunk_bytes", "chunk_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"kernels_pallas/linear_cross_entropy/config.py: "
                    f"LinearCrossEntropyConfig.{name} must be a positive int, "
                    f"got {value!r}."
                )


# The H200's budget: 256 MiB chunks, ~512 tokens of a 128k vocabulary per matmul.
H200_CONFIG = LinearCrossEntropyConfig()
DEFAULT_CONFIG = H200_CONFIG
# Any other device: a quarter of the H200 budget (64 MiB per fp32 logits block, ~128 tokens of a 128k
# vocabulary), which leaves room on GPUs with a fraction of the H200's memory.
CONSERVATIVE_CONFIG = LinearCrossEntropyConfig(logits_chunk_bytes=64 * _MIB)
# The Hopper parts the H200's budget runs on: the H200, and the H100 (80 GB: a 256 MiB block is 0.3% of it), where
# the conservative budget would give GPT-OSS-20B's 201k vocabulary 83-token chunks, below one 128-row matmul tile.
_MEASURED_KINDS = ("H200", "H100")


def config_for(device_kind: str) -> LinearCrossEntropyConfig:
    """The chunking config of a device (``jax.Device.device_kind``): ``H200_CONFIG`` where the kind names an
    H200 or an H100 (``_MEASURED_KINDS``), ``CONSERVATIVE_CONFIG`` elsewhere."""
    return H200_CONFIG if any(k in str(device_kind) for k in _MEASURED_KINDS) else CONSERVATIVE_CONFIG


def tiles_for(device_kind: str, num_tokens: int, vocab_size: int) -> int:
    """Tokens per chunk for this device and problem: ``default_chunk_size`` under ``config_for``."""
    return default_chunk_size(num_tokens, vocab_size, config_for(device_kind))


def default_chunk_size(
    num_tokens: int,
    vocab_size: int,
    config: LinearCrossEntropyConfig = DEFAULT_CONFIG,
) -> int:
    """Tokens per chunk so that ``chunk * vocab_size * 4 <= logits_chunk_bytes``, rounded down to a
    multiple of ``config.chunk_multiple``, and never below one multiple: a chunk narrower than one matmul tile
    leaves the tensor cores idle for a budget that one tile's block exceeds only a little (GPT-OSS-20B's
    201,088-word vocabulary under a 64 MiB budget: 83 tokens, 198 chunk iterations at 16,384 tokens, against 128
    tokens' 103 MB block).

    The result is at most ``num_tokens`` (a single chunk when everything fits).
    """
    if num_tokens <= 0 or vocab_size <= 0:
        raise ValueError(
            "kernels_pallas/linear_cross_entropy/config.py: default_chunk_size "
            f"needs positive sizes, got num_tokens={num_tokens}, "
            f"vocab_size={vocab_size}."
        )
    chunk = max(config.chunk_multiple, config.logits_chunk_bytes // (vocab_size * 4))
    chunk -= chunk % config.chunk_multiple
    return min(chunk, num_tokens)
