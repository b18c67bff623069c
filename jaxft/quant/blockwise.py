"""bitsandbytes' blockwise 4-bit quantisation (and the 8-bit double quantisation of its absmax), in JAX.

For a weight W [out, in] in torch's row-major layout, flattened to w [n]:

    absmax[b] = max_k |w[k]| over block b = k // blocksize           (float32; blocksize 32..4096)
    x[k]      = clip(w[k] * (1 / absmax[b]), -1, 1)                   (reciprocal, then multiply; absmax
                                                                       clamped to 1e-38 so a zero block is 0)
    q[k]      = the nearest entry of the 16-value code: the number of midpoints (code[i] + code[i+1]) / 2
                (float32, sorted code) strictly below x[k] (FP4's code is not sorted: that sorted index is
                mapped back to the FP4 bit pattern)
    packed[j] = q[2j] << 4 | q[2j + 1]                                (first value in the HIGH nibble)

Double quantisation ("compress statistics") stores the absmax in 8 bits:

    offset  = mean(absmax)   (float32; see `double_quantize` on how the mean is rounded)
    a       = absmax - offset, in blocks of 256 (`nested_blocksize`)
    nested_absmax[c] = max |a| over block c;   qa = the 8-bit "dynamic" code of a * (1 / nested_absmax[c])
    absmax ~= dynamic[qa] * nested_absmax[c] + offset

Rounding to the 8-bit code differs between bitsandbytes' backends: its CUDA kernel takes the nearest code
value (`nested_rounding="cuda"`, the default: what checkpoints quantised on a GPU contain), its CPU kernel
goes through a 65536-entry lookup table over [-1, 1] that, for values within ~1.5e-5 of a midpoint, can pick
the neighbour (`nested_rounding="cpu"`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas.nf4_matmul.codes import DYNAMIC, code_4bit

__all__ = ["BLOCKSIZES", "NESTED_ROUNDINGS", "Quantized4bit", "dequantize_absmax", "double_quantize",
           "quantize_4bit", "quantize_4bit_batch", "quantize_blockwise_8bit"]

BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
NESTED_ROUNDINGS = ("cuda", "cpu")
_LUT_SIZE = 65536
_F32 = jnp.float32


def _midpoints(code: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float32 midpoints of the sorted code, sorted position -> code index)."""
    order = np.argsort(code, kind="stable")
    s = code[order]
    return ((s[:-1] + s[1:]) / np.float32(2)).astype(np.float32), order.astype(np.int32)


def _blocks(flat: jax.Array, blocksize: int) -> jax.Array:
    n = flat.shape[0]
    nb = -(-n // blocksize)
    return jnp.pad(flat, (0, nb * blocksize - n)).reshape(nb, blocksize)  # zero padding leaves every absmax as is


@jax.jit(static_argnames=("blocksize", "quant_type"))
def _quantize_4bit(w: jax.Array, blocksize: int, quant_type: str) -> tuple[jax.Array, jax.Array]:
    flat = w.reshape(-1).astype(_F32)
    n = flat.shape[0]
    blocks = _blocks(flat, blocksize)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    x = jnp.clip(blocks * (1.0 / jnp.maximum(absmax, 1e-38))[:, None], -1.0, 1.0).reshape(-1)[:n]
    bounds, order = _midpoints(code_4bit(quant_type))
    q = jnp.searchsorted(jnp.asarray(bounds), x, side="left")  # = #midpoints < x
    q = jnp.asarray(order)[q].astype(jnp.uint8)
    q = jnp.pad(q, (0, n % 2))
    packed = (q[0::2] << 4) | q[1::2]
    return packed, absmax


def _lut() -> np.ndarray:
    # The CPU kernel's table: bin i stands for -1 + 2i/65535 and holds the number of code midpoints below it.
    val = np.float32(-1.0) + (np.float32(2.0) * np.arange(_LUT_SIZE, dtype=np.float32)) / np.float32(_LUT_SIZE - 1)
    mids = (np.float32(0.5) * (DYNAMIC[:-1] + DYNAMIC[1:])).astype(np.float32)
    return np.searchsorted(mids, val.astype(np.float32), side="left").astype(np.uint8)


_DYNAMIC_LUT = _lut()


@jax.jit(static_argnames=("blocksize", "rounding"))
def _quantize_8bit(values: jax.Array, blocksize: int, rounding: str) -> tuple[jax.Array, jax.Array]:
    flat = values.reshape(-1).astype(_F32)
    n = flat.shape[0]
    blocks = _blocks(flat, blocksize)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    x = (blocks * (1.0 / absmax)[:, None]).reshape(-1)[:n]
    x = jnp.where(jnp.isfinite(x), x, 0.0)  # an all-zero block: every value is 0 whatever its code
    if rounding == "cuda":
        q = jnp.searchsorted(jnp.asarray(_midpoints(DYNAMIC)[0]), jnp.clip(x, -1.0, 1.0), side="left")
    else:
        # The bin of x: (x + 1) * 0.5 * 65535 + 0.5 truncated. float32 steps (whether the kernel fuses the last
        # multiply-add or not picks the same bin for every float32 x tested: 2M uniform draws).
        idx = (jnp.clip(x, -1.0, 1.0) + 1.0) * 0.5 * (_LUT_SIZE - 1) + 0.5
        q = jnp.asarray(_DYNAMIC_LUT)[idx.astype(jnp.int32)]
    return q.astype(jnp.uint8), absmax


def quantize_blockwise_8bit(values, *, blocksize: int = 256, rounding: str = "cuda") -> tuple[jax.Array, jax.Array]:
    """(uint8 codes [n], float32 absmax [ceil(n / blocksize)]) of `values` in the 8-bit dynamic code."""
    if rounding not in NESTED_ROUNDINGS:
        raise ValueError(f"jaxft/quant/blockwise.py: nested_rounding={rounding!r}; use one of {NESTED_ROUNDINGS}")
    return _quantize_8bit(jnp.asarray(values), int(blocksize), rounding)


def mean_f32(values) -> np.float32:
    """The float32 mean of `values`, rounded once from a float64 sum (order-independent, so the same on every
    device; bitsandbytes takes torch's float32 mean, whose summation order makes it differ by an ulp or two)."""
    return np.float32(np.asarray(values, np.float64).mean())


@dataclasses.dataclass(frozen=True)
class Quantized4bit:
    """One weight in bitsandbytes' 4-bit format. `absmax` is float32 [blocks] without double quantisation, or
    uint8 [blocks] with it (then `nested_absmax` float32 [ceil(blocks / nested_blocksize)] and `offset`)."""

    packed: jax.Array
    absmax: jax.Array
    shape: tuple[int, int]
    blocksize: int
    quant_type: str
    nested_absmax: jax.Array | None = None
    offset: float | None = None
    nested_blocksize: int = 256

    @property
    def double_quant(self) -> bool:
        return self.nested_absmax is not None

    def absmax_f32(self) -> jax.Array:
        if not self.double_quant:
            return self.absmax
        return dequantize_absmax(self.absmax, self.nested_absmax, self.offset, self.nested_blocksize)


def double_quantize(absmax, *, blocksize: int = 256, rounding: str = "cuda", offset=None):
    """(uint8 codes, nested absmax, offset) of the float32 block absmax: absmax - offset in the 8-bit code.

    `offset` defaults to `mean_f32(absmax)`."""
    offset = mean_f32(absmax) if offset is None else np.float32(offset)
    q, nested = quantize_blockwise_8bit(jnp.asarray(absmax, _F32) - offset, blocksize=blocksize, rounding=rounding)
    return q, nested, float(offset)


@jax.jit(static_argnames=("blocksize",))
def _dequantize_absmax(q, nested, offset, blocksize):
    n = q.shape[-1]
    values = _blocks(jnp.asarray(DYNAMIC)[q.astype(jnp.int32)], blocksize) * nested[:, None]
    # Two roundings, as bitsandbytes (multiply in its kernel, add in torch): the barrier stops XLA from fusing
    # them into one fused multiply-add, which rounds once and gives other absmax bits.
    values = jax.lax.optimization_barrier(values)
    return values.reshape(-1)[:n] + offset


def dequantize_absmax(q: jax.Array, nested_absmax: jax.Array, offset, nested_blocksize: int = 256) -> jax.Array:
    """float32 absmax from double quantisation: dynamic[q] * nested_absmax[block] + offset."""
    return _dequantize_absmax(q, nested_absmax, jnp.asarray(offset, _F32), int(nested_blocksize))


def _check_format(quant_type: str, blocksize: int) -> None:
    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"jaxft/quant/blockwise.py: quant_type={quant_type!r}; use 'nf4' or 'fp4'")
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"jaxft/quant/blockwise.py: blocksize={blocksize!r}; use one of {BLOCKSIZES}")


def quantize_4bit(w, *, quant_type: str = "nf4", blocksize: int = 64, double_quant: bool = True,
                  nested_blocksize: int = 256, nested_rounding: str = "cuda") -> Quantized4bit:
    """bitsandbytes' `quantize_4bit` of a weight in torch's [out, in] layout (any float dtype; see the module
    docstring), computed where `w` lives (pass a device array to quantise on the accelerator)."""
    _check_format(quant_type, blocksize)
    w = jnp.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"jaxft/quant/blockwise.py: quantize_4bit takes one [out, in] weight, got shape {w.shape}")
    packed, absmax = _quantize_4bit(w, blocksize, quant_type)
    shape = (int(w.shape[0]), int(w.shape[1]))
    if not double_quant:
        return Quantized4bit(packed, absmax, shape, blocksize, quant_type)
    q, nested, offset = double_quantize(absmax, blocksize=nested_blocksize, rounding=nested_rounding)
    return Quantized4bit(packed, q, shape, blocksize, quant_type, nested, offset, nested_blocksize)


def quantize_4bit_batch(w, *, quant_type: str = "nf4", blocksize: int = 64, double_quant: bool = True,
                        nested_blocksize: int = 256, nested_rounding: str = "cuda") -> dict[str, jax.Array]:
    """`quantize_4bit` of each [out, in] matrix of w [G, out, in] (a layer's experts), in one vmapped program:
    {packed [G, ceil(out*in/2)], absmax [G, blocks] (uint8 with double quantisation, else float32) and with it
    nested_absmax [G, nested blocks], offset [G]}, each row byte-identical to `quantize_4bit(w[g])` (the same
    jitted formulas; the offsets are each matrix's own `mean_f32`, so double quantisation is per matrix, as
    bitsandbytes quantises each expert's weight on its own)."""
    _check_format(quant_type, blocksize)
    if nested_rounding not in NESTED_ROUNDINGS:
        raise ValueError(f"jaxft/quant/blockwise.py: nested_rounding={nested_rounding!r}; use one of {NESTED_ROUNDINGS}")
    w = jnp.asarray(w)
    if w.ndim != 3:
        raise ValueError(f"jaxft/quant/blockwise.py: quantize_4bit_batch takes [G, out, in] weights, got shape {w.shape}")
    packed, absmax = jax.vmap(lambda m: _quantize_4bit(m, blocksize, quant_type))(w)
    if not double_quant:
        return {"packed": packed, "absmax": absmax}
    offsets = np.array([mean_f32(row) for row in np.asarray(absmax)], np.float32)  # host: float64 sums
    centred = absmax - jnp.asarray(offsets)[:, None]
    q, nested = jax.vmap(lambda a: _quantize_8bit(a, int(nested_blocksize), nested_rounding))(centred)
    return {"packed": packed, "absmax": q, "nested_absmax": nested, "offset": jnp.asarray(offsets)}
