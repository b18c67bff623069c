"""The 4-bit matmul with the dequantisation inside the matmul's K loop: Pallas kernels on the Triton backend.
Taken out of kernels_pallas.nf4_matmul's dispatch: its "xla" implementation (dequantise, then cuBLAS) was 2.5-4.7x
faster on the H200 at training sizes. Called directly: nf4_matmul_triton(x, packed, absmax, shape=, blocksize=).

What it computes is kernels_pallas/nf4_matmul/reference.py's y = x W^T (and dx = dy W), W = code[q] * absmax rounded
once to x's dtype; the kernels never write W to memory, each tile of it is rebuilt in registers from its bytes where a
matmul needs it.

The byte layout and the pair split. bitsandbytes stores W [out, in] row-major, two values a byte, the even flat
index in the HIGH nibble. When in % blocksize == 0 and the block size is even, row o of W and its block c (columns
c*bs .. c*bs + bs - 1, bs = blocksize, h = bs / 2) are the bytes P[o, c*h : c*h + h] of P = packed.reshape(out,
in / 2), with one scale absmax[o * in/bs + c]:

    W[o, c*bs + 2j]     = code[P[o, c*h + j] >> 4]  * s[o, c]         (the "high" half of the block)
    W[o, c*bs + 2j + 1] = code[P[o, c*h + j] & 15]  * s[o, c]         (the "low" half)

So, with x's columns permuted within each block (even ones first, then odd: `split_pairs`, one pass over x
outside the kernel),

    y  = sum_c  xp[:, c*bs : c*bs + h] Whi_c^T  +  xp[:, c*bs + h : (c+1)*bs] Wlo_c^T          (forward)
    dxp[:, c*bs : c*bs + h] = dy Whi_c,   dxp[:, c*bs + h : (c+1)*bs] = dy Wlo_c,   dx = unsplit(dxp)    (backward)

Whi_c / Wlo_c [out, h] are contiguous byte tiles, so every load is a plain 2-D tile and no interleave is needed in
registers. The 16-entry code book is a 4-level tree of selects on the nibble's bits (Triton has no gather from a
table in registers). The gradient: y is linear in x, so dx = dy W needs no residual but the packed weight and its
scales, which exist anyway; W gets no gradient (frozen, integer-coded).

Cost, and why this can lose to dequantise-then-matmul (xla.py) at training sizes: a tile of W is rebuilt once per
tile of rows (M / block_m times over the step) at about 20 integer/select operations an element on the CUDA cores,
against block_m multiply-adds an element on the tensor cores; XLA dequantises each weight once per call (one pass
over 4-bit bytes) and runs cuBLAS on the result. bench.py measures both.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas._dispatch import GPU_PLATFORMS, target_platform
from kernels_pallas._triton import dot_f32 as _dot

from kernels_pallas.nf4_matmul.codes import code_4bit

_WHERE = "experiments/kernels/nf4_triton.py"
FWD_NAME = "jaxft_nf4_matmul_fwd"  # the kernels' names in a compiled program (tests look for them)
DX_NAME = "jaxft_nf4_matmul_dx"


@dataclasses.dataclass(frozen=True)
class Nf4TileConfig:
    """Tiles: block_m rows of x per program; block_n weight rows per program (forward) or per K-loop step
    (backward); num_warps / num_stages as Triton takes them."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3


DEFAULT_CONFIG = Nf4TileConfig()


def supports(shape: tuple[int, int], blocksize: int, config: Nf4TileConfig = DEFAULT_CONFIG) -> bool:
    """The kernels' layout: whole blocks per weight row (in % blocksize == 0), half a block a power of two of at
    least 16 (a tensor-core dot's K), and weight rows in whole tiles of block_n."""
    out_features, in_features = shape
    half = blocksize // 2
    return (blocksize % 2 == 0 and half >= 16 and half & (half - 1) == 0 and in_features % blocksize == 0
            and out_features % config.block_n == 0)


def split_pairs(x: jax.Array, blocksize: int) -> jax.Array:
    """x [m, in] -> the same columns with each block's even ones first, odd ones second (see the module doc)."""
    m, k = x.shape
    return x.reshape(m, k // blocksize, blocksize // 2, 2).swapaxes(-1, -2).reshape(m, k)


def unsplit_pairs(xp: jax.Array, blocksize: int) -> jax.Array:
    """Inverse of `split_pairs`."""
    m, k = xp.shape
    return xp.reshape(m, k // blocksize, 2, blocksize // 2).swapaxes(-1, -2).reshape(m, k)


def _lookup(nibble: jax.Array, table: tuple[float, ...]) -> jax.Array:
    """table[nibble] (float32) for int32 nibbles in [0, 16): a tree of selects on bits 0..3."""
    level = [jnp.float32(v) for v in table]
    for bit in range(4):
        on = ((nibble >> bit) & 1) == 1
        level = [jnp.where(on, level[2 * i + 1], level[2 * i]) for i in range(len(level) // 2)]
    return level[0]


def _weight_halves(p_ref, s, rows, col, half, table, dtype):
    """The high and low halves [rows, half] of one block of W, from its bytes P[rows, col : col + half] and the
    rows' scales s [rows] (float32): code * scale in float32, rounded once to `dtype` (reference.py's rounding)."""
    q = p_ref[rows, pl.ds(col, half)].astype(jnp.int32)
    hi = (_lookup(q >> 4, table) * s[:, None]).astype(dtype)
    lo = (_lookup(q & 15, table) * s[:, None]).astype(dtype)
    return hi, lo


def _fwd_kernel(x_ref, p_ref, s_ref, y_ref, *, blocksize, table, cfg):
    """y[i-tile, j-tile] = sum over blocks c of xp_even_c Whi_c^T + xp_odd_c Wlo_c^T (fp32 accumulation)."""
    i, j = pl.program_id(0), pl.program_id(1)
    bm, bn, half = cfg.block_m, cfg.block_n, blocksize // 2
    rows_x = pl.ds(pl.multiple_of(i * bm, bm), bm)
    rows_w = pl.ds(pl.multiple_of(j * bn, bn), bn)
    dtype = x_ref.dtype

    def body(c, acc):
        col = pl.multiple_of(c * blocksize, blocksize)
        s = s_ref[c, rows_w]
        hi, lo = _weight_halves(p_ref, s, rows_w, pl.multiple_of(c * half, half), half, table, dtype)
        x_even = x_ref[rows_x, pl.ds(col, half)]
        x_odd = x_ref[rows_x, pl.ds(col + half, half)]
        acc += _dot(x_even, hi, 1, 1)
        return acc + _dot(x_odd, lo, 1, 1)

    acc = lax.fori_loop(0, x_ref.shape[1] // blocksize, body, jnp.zeros((bm, bn), jnp.float32))
    y_ref[...] = acc.astype(y_ref.dtype)


def _bwd_kernel(dy_ref, p_ref, s_ref, dx_ref, *, blocksize, table, cfg):
    """dxp[i-tile, block c] = (dy Whi_c, dy Wlo_c), the K loop over weight rows in tiles of block_n."""
    i, c = pl.program_id(0), pl.program_id(1)
    bm, bn, half = cfg.block_m, cfg.block_n, blocksize // 2
    rows_x = pl.ds(pl.multiple_of(i * bm, bm), bm)
    col = pl.multiple_of(c * half, half)
    dtype = dy_ref.dtype

    def body(n, carry):
        acc_hi, acc_lo = carry
        rows_w = pl.ds(pl.multiple_of(n * bn, bn), bn)
        s = s_ref[c, rows_w]
        hi, lo = _weight_halves(p_ref, s, rows_w, col, half, table, dtype)
        dy = dy_ref[rows_x, rows_w]
        return acc_hi + _dot(dy, hi, 1, 0), acc_lo + _dot(dy, lo, 1, 0)

    zero = jnp.zeros((bm, half), jnp.float32)
    acc_hi, acc_lo = lax.fori_loop(0, p_ref.shape[0] // bn, body, (zero, zero))
    dx_ref[:, pl.ds(0, half)] = acc_hi.astype(dx_ref.dtype)
    dx_ref[:, pl.ds(half, half)] = acc_lo.astype(dx_ref.dtype)


def _interpret() -> bool:
    return target_platform() not in GPU_PLATFORMS


def _operands(packed, absmax, shape, blocksize):
    """P [out, in/2] (bytes by weight row) and the scales by block column, S [in/bs, out] (so a K-loop step
    reads one contiguous row of them)."""
    out_features, in_features = shape
    p = packed.reshape(out_features, in_features // 2)
    s = absmax.astype(jnp.float32).reshape(out_features, in_features // blocksize).T
    return p, s


def _pad_rows(a, bm):
    m = a.shape[0]
    return jnp.pad(a, ((0, -m % bm), (0, 0))), m


def _call(kernel, operands, *, grid, out_specs, out_shape, name, blocksize, quant_type, cfg):
    """One of the two kernels over (rows or cotangent, P, S), each operand whole (the kernels slice them)."""
    return pl.pallas_call(
        functools.partial(kernel, blocksize=blocksize, table=tuple(map(float, code_4bit(quant_type))), cfg=cfg),
        grid=grid, in_specs=[pl.no_block_spec] * len(operands), out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=_interpret(), name=name,
    )(*operands)


def _forward(x2, packed, absmax, shape, blocksize, quant_type, cfg):
    out_features, _ = shape
    xp, m = _pad_rows(split_pairs(x2, blocksize), cfg.block_m)
    y = _call(_fwd_kernel, (xp, *_operands(packed, absmax, shape, blocksize)),
              grid=(xp.shape[0] // cfg.block_m, out_features // cfg.block_n),
              out_specs=pl.BlockSpec((cfg.block_m, cfg.block_n), lambda i, j: (i, j)),
              out_shape=jax.ShapeDtypeStruct((xp.shape[0], out_features), x2.dtype), name=FWD_NAME,
              blocksize=blocksize, quant_type=quant_type, cfg=cfg)
    return y[:m]


def _input_grad(dy2, packed, absmax, shape, blocksize, quant_type, cfg):
    _, in_features = shape
    dyp, m = _pad_rows(dy2, cfg.block_m)
    dxp = _call(_bwd_kernel, (dyp, *_operands(packed, absmax, shape, blocksize)),
                grid=(dyp.shape[0] // cfg.block_m, in_features // blocksize),
                out_specs=pl.BlockSpec((cfg.block_m, blocksize), lambda i, c: (i, c)),
                out_shape=jax.ShapeDtypeStruct((dyp.shape[0], in_features), dy2.dtype), name=DX_NAME,
                blocksize=blocksize, quant_type=quant_type, cfg=cfg)
    return unsplit_pairs(dxp[:m], blocksize)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _matmul(x2, packed, absmax, shape, blocksize, quant_type, cfg):
    return _forward(x2, packed, absmax, shape, blocksize, quant_type, cfg)


def _fwd(x2, packed, absmax, shape, blocksize, quant_type, cfg):
    return _forward(x2, packed, absmax, shape, blocksize, quant_type, cfg), (packed, absmax)


def _bwd(shape, blocksize, quant_type, cfg, residuals, dy):
    packed, absmax = residuals
    return _input_grad(dy, packed, absmax, shape, blocksize, quant_type, cfg), None, None


_matmul.defvjp(_fwd, _bwd)


def nf4_matmul_triton(x: jax.Array, packed: jax.Array, absmax: jax.Array, *, shape: tuple[int, int],
                      blocksize: int, quant_type: str = "nf4", config: Nf4TileConfig = DEFAULT_CONFIG) -> jax.Array:
    """y = x W^T with W dequantised tile by tile inside the kernels (see the module docstring); x [..., in]."""
    shape = tuple(int(d) for d in shape)
    if not supports(shape, blocksize, config):
        raise ValueError(f"{_WHERE}: weight {shape} in blocks of {blocksize} is outside the kernel's layout "
                         f"(in % blocksize == 0, blocksize / 2 a power of two >= 16, out % {config.block_n} == 0); "
                         "use implementation='xla'")
    lead = x.shape[:-1]
    y = _matmul(x.reshape(-1, shape[1]), packed, absmax, shape, int(blocksize), quant_type, config)
    return y.reshape(*lead, shape[0])
