"""Tile sizes / launch parameters of the flash kernels, and the ``auto`` policy.

Kernel tiles must divide the metadata blocks (metadata.py): a kernel tile then
lies inside exactly one metadata block, whose EMPTY/PARTIAL/FULL label holds
for the tile too.  ``fit_to_metadata`` clamps a config so that this holds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_WHERE = "kernels_pallas/attention/config.py"


def _pow2(x) -> bool:
    return isinstance(x, int) and x > 0 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """One pallas_call's tiling: block_q x block_k tiles, Triton warps/stages."""

    block_q: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k", "num_warps"):
            if not _pow2(getattr(self, name)):
                raise ValueError(f"{_WHERE}: BlockConfig.{name}={getattr(self, name)!r} must be a power of two.")
        if self.block_q < 16 or self.block_k < 16:
            raise ValueError(f"{_WHERE}: block sizes must be >= 16 (tensor-core tile), got {self}.")
        if not (isinstance(self.num_stages, int) and self.num_stages >= 1):
            raise ValueError(f"{_WHERE}: BlockConfig.num_stages={self.num_stages!r} must be an int >= 1.")


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Tilings of the three kernels: forward, dQ, and dK/dV."""

    fwd: BlockConfig
    dq: BlockConfig
    dkdv: BlockConfig


HEAD_DIMS = (64, 128, 256)

# Tilings measured or verified on an H200 (jax.devices()[0].device_kind "NVIDIA H200"), by head_dim.
# head_dim 128: winners of the sweep in experiments/probes/bench_attention.py (--tune-shape dense_8k,
# docs/results/attention_h200.json).  head_dim 64 / 256: not swept; tilings that keep the fp32
# accumulators ([block, head_dim] per output) in registers, verified on the H200 by the gpu tests in
# tests/test_attention.py.
H200_TILES: dict[int, FlashConfig] = {
    64: FlashConfig(BlockConfig(128, 64, 4, 3), BlockConfig(64, 64, 4, 2), BlockConfig(64, 64, 4, 2)),
    128: FlashConfig(BlockConfig(128, 128, 8, 3), BlockConfig(128, 32, 4, 3), BlockConfig(32, 64, 4, 3)),
    256: FlashConfig(BlockConfig(64, 64, 8, 2), BlockConfig(32, 32, 4, 2), BlockConfig(32, 32, 8, 1)),
}

# Every other device (other GPUs, and CPU interpret mode): nothing was measured there, so small tiles and
# at most two pipeline stages.  Counting a q tile plus two stages of k and v tiles in bf16, each kernel
# needs <= 80 KiB of shared memory, under the ~100 KiB per block of sm_86/sm_89 GPUs (an estimate: these
# tilings were run only on the H200, by tests/test_attention.py).
CONSERVATIVE_TILES: dict[int, FlashConfig] = {
    64: FlashConfig(BlockConfig(64, 64, 4, 2), BlockConfig(64, 64, 4, 2), BlockConfig(64, 64, 4, 2)),
    128: FlashConfig(BlockConfig(64, 64, 4, 2), BlockConfig(64, 32, 4, 2), BlockConfig(32, 64, 4, 2)),
    256: FlashConfig(BlockConfig(32, 32, 4, 2), BlockConfig(32, 32, 4, 2), BlockConfig(32, 32, 4, 1)),
}


def tiles_for(device_kind: str, head_dim: int) -> FlashConfig:
    """Kernel tilings for a device (``jax.Device.device_kind``) and head_dim.

    The measured table applies only where it was measured: a device kind containing "H200".  Any other
    device gets ``CONSERVATIVE_TILES`` (correct everywhere; tiles only change speed).
    """
    if head_dim not in HEAD_DIMS:
        raise ValueError(
            f"{_WHERE}: head_dim={head_dim} is not supported by the Pallas kernels; "
            f"use one of {HEAD_DIMS} (or implementation='reference')."
        )
    table = H200_TILES if "H200" in str(device_kind) else CONSERVATIVE_TILES
    return table[head_dim]


def default_flash_config(head_dim: int) -> FlashConfig:
    """Tilings for the default device (``jax.devices()[0]``): ``tiles_for(its device_kind, head_dim)``."""
    return tiles_for(jax.devices()[0].device_kind, head_dim)


def fit_to_metadata(cfg: FlashConfig, meta_block_q: int, meta_block_k: int) -> FlashConfig:
    """Shrink each kernel tile to at most the metadata block (both powers of two,
    so the tile then divides the block)."""

    def fit(c: BlockConfig) -> BlockConfig:
        return dataclasses.replace(
            c, block_q=min(c.block_q, meta_block_q), block_k=min(c.block_k, meta_block_k)
        )

    return FlashConfig(fit(cfg.fwd), fit(cfg.dq), fit(cfg.dkdv))


# ---------------------------------------------------------------------------
# implementation="auto"
# ---------------------------------------------------------------------------

# Fastest fwd+bwd implementation measured on an H200 (bf16, H=32, KV=8, D=128,
# 16k tokens per batch) by experiments/probes/bench_attention.py; results in
# docs/results/attention_h200.json.  Keys: (layout, T) with layout "dense",
# "packed" (segment_ids given) or "window" (dense rows, causal window).
# packed_32k: cuDNN's packed backward ran out of memory (110 GiB request).
MEASURED_FASTEST: dict[tuple[str, int], str] = {
    ("dense", 2048): "cudnn",  # 2.83 ms vs pallas 4.23 ms
    ("dense", 8192): "cudnn",  # 7.55 vs 14.82
    ("dense", 32768): "cudnn",  # 56.8 vs 114.1
    ("packed", 8192): "pallas",  # 2.44 vs cudnn 3.25
    ("packed", 32768): "pallas",  # 4.31; cudnn backward OOM
    ("window", 32768): "cudnn",  # 15.1 vs 27.5
}


def supported_implementations(
    q_shape, k_shape, dtype, has_segments: bool, *, causal, sliding_window,
    logit_softcap, sinks, scale, backend: str | None = None,
) -> tuple[str, ...]:
    """Implementations able to compute this call natively on the current backend."""
    del k_shape, scale
    impls = ["reference"]
    on_gpu = (backend or jax.default_backend()) == "gpu"
    d = q_shape[-1]
    if on_gpu and d in (64, 128, 256):
        impls.append("pallas")
    # Sinks on cuDNN only on dense rows (sinks.py: a correction from cuDNN's statistics); packed rows with
    # sinks stay on the Pallas kernel.
    if (on_gpu and logit_softcap is None and (sinks is None or not has_segments)
            and (causal or sliding_window is None)
            and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and d % 8 == 0 and d <= 256):
        impls.append("cudnn")
    return tuple(impls)


def choose_implementation(
    q_shape, k_shape, dtype, has_segments: bool, *, causal, sliding_window,
    logit_softcap, sinks, scale, backend: str | None = None,
) -> str:
    """Pick, per shape, the measured-fastest implementation supporting the call.

    Off-GPU this is always "reference" (Pallas interpret mode is a test vehicle, not a
    fast path).  On GPU: look up MEASURED_FASTEST at the nearest measured T for
    the layout; fall back to "pallas".  Packed rows therefore always get
    "pallas" (measured fastest, and cuDNN's packed backward ran out of memory).
    """
    impls = supported_implementations(
        q_shape, k_shape, dtype, has_segments, causal=causal, sliding_window=sliding_window,
        logit_softcap=logit_softcap, sinks=sinks, scale=scale, backend=backend,
    )
    if "pallas" not in impls:
        return "cudnn" if "cudnn" in impls else "reference"
    # Segments take precedence: the packed path of cuDNN was only measured with a
    # known segment count, while the API cannot bound it (it would use M = T).
    layout = "packed" if has_segments else ("window" if sliding_window is not None else "dense")
    t = q_shape[1]
    measured = [(abs(tt - t), impl) for (lay, tt), impl in MEASURED_FASTEST.items() if lay == layout]
    if measured:
        best = min(measured)[1]
        if best in impls:
            return best
    return "pallas"
