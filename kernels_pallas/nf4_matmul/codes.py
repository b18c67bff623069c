"""The code books of bitsandbytes' 4-bit and 8-bit blockwise formats, as float32 tables.

A 4-bit value is an index into a 16-entry table in [-1, 1]; it is multiplied by its block's absmax:

    w[k] = code[q[k]] * absmax[k // blocksize]

* NF4 (QLoRA's NormalFloat): the 16 values are quantiles of N(0, 1) scaled to [-1, 1], 8 negative, zero and
  7 positive (one more level on the positive side), sorted: index 0 is -1, index 7 is 0, index 15 is 1.
* FP4: 1 sign bit, 2 exponent bits, 1 mantissa bit (exponent bias 2, subnormal 0.0625), divided by 12 so the
  largest magnitude is 1; listed in bit-pattern order (index 8..15 are the negatives of 0..7), not sorted.
* The 8-bit "dynamic" map quantises the absmax of double quantisation: signed, a leading run of zero bits
  picks the decade (1e-6 .. 1) and the remaining bits split [0.1, 1] of that decade linearly; 0 and 1 are
  added and the 256 values sorted.
"""

from __future__ import annotations

import numpy as np

# QLoRA's NF4 levels as bitsandbytes stores them (float32), index = the 4-bit value.
NF4 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], np.float32)

# FP4 (e2m1, bias 2) magnitudes by bit pattern 0b000..0b111, then the same with the sign bit set.
_FP4_MAGNITUDES = np.array([0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0], np.float32)
FP4 = np.concatenate([_FP4_MAGNITUDES, -_FP4_MAGNITUDES]) / np.float32(12.0)

QUANT_TYPES = ("nf4", "fp4")


def code_4bit(quant_type: str) -> np.ndarray:
    """The 16-entry float32 table of "nf4" or "fp4"."""
    if quant_type == "nf4":
        return NF4
    if quant_type == "fp4":
        return FP4
    raise ValueError(f"kernels_pallas/nf4_matmul/codes.py: quant_type={quant_type!r}; use one of {QUANT_TYPES}")


def _linspace_f32(start: float, end: float, steps: int) -> np.ndarray:
    # A float32 linspace from both ends, each point one fused multiply-add rounded once (start + i*step for the
    # first half, end - (n-1-i)*step for the second): how the reference library builds the map's boundaries,
    # and the map must be bit-identical (it is stored in every checkpoint as nested_quant_map).
    s, e = np.float32(start), np.float32(end)
    step = np.float64(np.float32((e - s) / np.float32(steps - 1)))
    i = np.arange(steps, dtype=np.float64)
    half = steps // 2
    lo = (step * i[:half] + np.float64(s)).astype(np.float32)  # exact product + sum in float64 = one fp32 FMA
    hi = (np.float64(e) - step * (steps - 1 - i[half:])).astype(np.float32)
    return np.concatenate([lo, hi])


def dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
    """The 256-entry sorted float32 "dynamic" map (signed, 7 exponent bits, 8 bits: bitsandbytes' default)."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed else \
            2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        bounds = _linspace_f32(0.1, 1.0, items)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2.0)
        scaled = (np.float32(10.0 ** (-(max_exponent_bits - 1) + i)) * means).astype(np.float32)
        data += scaled.tolist()
        if signed:
            data += (-scaled).tolist()
    if additional > 0:
        bounds = _linspace_f32(0.1, 1.0, additional + 1)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2.0)
        scaled = (np.float32(10.0 ** (-(max_exponent_bits - 1) + i)) * means).astype(np.float32)
        data += scaled.tolist()
        if signed:
            data += (-scaled).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (2**total_bits - len(data))
    return np.sort(np.array(data, np.float32))


DYNAMIC = dynamic_map()
