"""Flash attention (forward, dQ, dK/dV) as Pallas kernels on the Triton backend.

Backend choice: jax 0.11.2 lowers ``pl.pallas_call`` on NVIDIA GPUs through the
Triton backend (deprecated in favour of Mosaic GPU, whose Pallas entry point is
``plgpu.kernel``/warp-specialised pipelines with a different programming
model).  Triton gives a working, portable first kernel with tensor-core dots and
software pipelining on Hopper; a Mosaic GPU port (TMA + wgmma) is future work.
On CPU the same kernels run with ``interpret=True`` (tests).

Notation for one (batch b, head h) and the padded length Tp:
    s_ij  = scale * q_i . k_j                         (fp32 accumulation)
    c_ij  = cap * tanh(s_ij / cap)  if softcap else s_ij
    z_ij  = c_ij if keep(i, j) else -inf              (metadata.py / reference.py)
    lse_i = log( exp(sink_h) [if sinks] + sum_j exp(z_ij) )
    p_ij  = exp(z_ij - lse_i),      o_i = sum_j p_ij v_j

Forward (online softmax, FlashAttention-2): for each q tile keep running max m,
denominator l and fp32 accumulator acc; a sink is an extra key with logit
sink_h and value 0, so it only initialises m = sink_h, l = 1.  Per kv tile:
    m' = max(m, rowmax z), alpha = exp(m - m'), P = exp(z - m')
    l  = alpha l + rowsum P,   acc = alpha acc + P V,   m = m'
and at the end o = acc / l, lse = m + log l (saved for the backward pass).
The kernels evaluate all of this in base 2 (z * log2 e, exp2, log2), which is
the same math with cheaper instructions.

Backward, with dO the output cotangent and delta_i = sum_d dO_id O_id:
    dV_j  = sum_i p_ij dO_i
    dP_ij = dO_i . v_j
    dZ_ij = p_ij (dP_ij - delta_i)        (softmax Jacobian: sum_j p_ij dP_ij = dO_i . O_i
                                           because the sink's value is 0)
    dS_ij = dZ_ij * (1 - tanh^2(s_ij/cap)) if softcap else dZ_ij   (chain rule of cap*tanh(s/cap))
    dQ_i  = scale * sum_j dS_ij k_j,      dK_j = scale * sum_i dS_ij q_i
    dsink_h = sum_i dZ_i,sink = -sum_i p_i,sink delta_i,  p_i,sink = exp(sink_h - lse_i)
Masked entries have p = 0, hence contribute nothing.  GQA: K/V head kv serves
query heads h = kv*G + g; the dK/dV kernel sums over g in-kernel, so no
[B,T,H,D]-sized dK/dV is ever materialised.

Block skipping: each kernel reads its loop range from the metadata (kv_lo/kv_hi
per q-block for forward and dQ, q_lo/q_hi per kv-block for dK/dV) and skips the
mask on FULL blocks (``lax.cond``).  EMPTY blocks inside a range are computed
with the mask (rare for packed rows; correct since they are fully masked).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas._dispatch import target_platform
from kernels_pallas._triton import dot_f32 as _dot
from kernels_pallas.attention.config import (
    BlockConfig,
    FlashConfig,
    default_flash_config,
    fit_to_metadata,
)
from kernels_pallas.attention.metadata import FULL, AttentionMetadata, check_compatible
from kernels_pallas.attention.residuals import name_output, name_stats

# Finite stand-in for -inf: exp(NEG - m) underflows to 0 for any real m, and a
# row whose first tiles are fully masked self-corrects (alpha = 0) once a kept
# key arrives.
NEG = -1e30
# Kernels work in base 2 (exp2 lowers to one ex2.approx instruction, exp to a
# libdevice call): scores and the saved lse are multiplied by log2(e).
LOG2E = 1.4426950408889634
_WHERE = "kernels_pallas/attention/flash.py"

FWD_NAME = "jaxft_flash_fwd"
DQ_NAME = "jaxft_flash_bwd_dq"
DKDV_NAME = "jaxft_flash_bwd_dkdv"


@dataclasses.dataclass(frozen=True)
class _Static:
    """Hashable compile-time parameters of one attention call."""

    causal: bool
    sliding_window: int | None
    logit_softcap: float | None
    scale: float
    has_sinks: bool
    meta_block_q: int
    meta_block_k: int
    config: FlashConfig
    interpret: bool


def _scores(q, k, st: _Static):
    """Returns (c2, t): capped scaled scores [bq, bk] in log2 units (c * log2 e,
    so the kernels can use exp2) and tanh(s/cap) (or None)."""
    if st.logit_softcap is None:
        return _dot(q, k, 1, 1) * (st.scale * LOG2E), None
    t = jnp.tanh(_dot(q, k, 1, 1) * (st.scale / st.logit_softcap))
    return t * (st.logit_softcap * LOG2E), t


def _mask(c, q_start, k_start, seg_q, seg_k, st: _Static):
    """Apply the keep-mask (segments, causal, window) to a [bq, bk] tile."""
    bq, bk = c.shape
    qpos = q_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    kpos = k_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    keep = seg_q[:, None] == seg_k[None, :]
    diff = qpos - kpos
    if st.causal:
        keep = keep & (diff >= 0)
    if st.sliding_window is not None:
        keep = keep & (diff < st.sliding_window)
    return jnp.where(keep, c, NEG)


def _masked_unless_full(kind, c, q_start, k_start, seg_q, seg_k, st: _Static):
    return lax.cond(
        kind == FULL,
        lambda x: x,
        lambda x: _mask(x, q_start, k_start, seg_q, seg_k, st),
        c,
    )



def _tile_kv_range(lo, hi, q_start, bq, bk, st: _Static):
    """Narrow a metadata kv range [lo, hi) (in kernel kv tiles) to the tiles the
    q tile [q_start, q_start + bq) can see: metadata blocks may be coarser than
    kernel tiles, so causal/window bounds are re-applied at tile granularity."""
    if st.causal:
        hi = jnp.minimum(hi, (q_start + bq + bk - 1) // bk)
    if st.sliding_window is not None:
        lo = jnp.maximum(lo, jnp.maximum(q_start - st.sliding_window + 1, 0) // bk)
    return lo, jnp.maximum(hi, lo)


def _tile_q_range(lo, hi, k_start, bq, bk, st: _Static):
    """Transpose of ``_tile_kv_range``: q tiles that can see kv tile [k_start, +bk)."""
    if st.causal:
        lo = jnp.maximum(lo, k_start // bq)
    if st.sliding_window is not None:
        hi = jnp.minimum(hi, (k_start + bk - 1 + st.sliding_window - 1) // bq + 1)
    return lo, jnp.maximum(hi, lo)


# ---------------------------------------------------------------------------
# Forward kernel: grid (B, H, Tp / bq); loops over kv tiles of the q-block's range.
# ---------------------------------------------------------------------------
def _fwd_kernel(kv_lo_ref, kv_hi_ref, kind_ref, segq_ref, segk_ref, sinks_ref,
                q_ref, k_ref, v_ref, o_ref, lse_ref, *, st: _Static, cfg: BlockConfig):
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk = cfg.block_q, cfg.block_k
    rq, rk = st.meta_block_q // bq, st.meta_block_k // bk
    im = i // rq
    q_start = i * bq
    lo, hi = _tile_kv_range(kv_lo_ref[b, im] * rk, kv_hi_ref[b, im] * rk, q_start, bq, bk, st)
    q = q_ref[...]
    seg_q = segq_ref[...]
    if st.has_sinks:
        m0 = jnp.full((bq,), sinks_ref[h] * LOG2E, jnp.float32)
        l0 = jnp.ones((bq,), jnp.float32)
    else:
        m0 = jnp.full((bq,), NEG, jnp.float32)
        l0 = jnp.zeros((bq,), jnp.float32)
    acc0 = jnp.zeros((bq, q.shape[-1]), jnp.float32)

    def body(j, carry):
        m, l, acc = carry
        k_start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(k_start, bk), :]
        v = v_ref[pl.ds(k_start, bk), :]
        seg_k = segk_ref[pl.ds(k_start, bk)]
        c, _ = _scores(q, k, st)
        kind = kind_ref[b, im, j // rk]
        z = _masked_unless_full(kind, c, q_start, k_start, seg_q, seg_k, st)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(z - m_new[:, None])
        l = alpha * l + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, 1, 0)
        return m_new, l, acc

    m, l, acc = lax.fori_loop(lo, hi, body, (m0, l0, acc0))
    l = jnp.where(l == 0.0, 1.0, l)  # only for rows with no kept key (contract excludes them)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(l)  # log2-units lse


def _flash_fwd(st: _Static, q, k, v, sinks, meta):
    seg, kind, kv_lo, kv_hi, _, _ = meta
    b, tp, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    cfg = st.config.fwd
    bq = cfg.block_q
    whole = pl.no_block_spec
    kernel = functools.partial(_fwd_kernel, st=st, cfg=cfg)
    o, lse = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((b, h, tp), jnp.float32),
        ),
        grid=(b, h, tp // bq),
        in_specs=[
            whole, whole, whole,
            pl.BlockSpec((None, bq), lambda bi, hi, i: (bi, i)),
            pl.BlockSpec((None, tp), lambda bi, hi, i: (bi, 0)),
            whole,
            pl.BlockSpec((None, bq, None, d), lambda bi, hi, i: (bi, i, hi, 0)),
            pl.BlockSpec((None, tp, None, d), lambda bi, hi, i: (bi, 0, hi // g, 0)),
            pl.BlockSpec((None, tp, None, d), lambda bi, hi, i: (bi, 0, hi // g, 0)),
        ],
        out_specs=(
            pl.BlockSpec((None, bq, None, d), lambda bi, hi, i: (bi, i, hi, 0)),
            pl.BlockSpec((None, None, bq), lambda bi, hi, i: (bi, hi, i)),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=st.interpret,
        name=FWD_NAME,
    )(kv_lo, kv_hi, kind, seg, seg, sinks, q, k, v)
    return o, lse


# ---------------------------------------------------------------------------
# dQ kernel: grid (B, H, Tp / bq); same kv range as the forward pass.
# ---------------------------------------------------------------------------
def _dq_kernel(kv_lo_ref, kv_hi_ref, kind_ref, segq_ref, segk_ref,
               q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref,
               *, st: _Static, cfg: BlockConfig):
    b, i = pl.program_id(0), pl.program_id(2)
    bq, bk = cfg.block_q, cfg.block_k
    rq, rk = st.meta_block_q // bq, st.meta_block_k // bk
    im = i // rq
    q_start = i * bq
    lo, hi = _tile_kv_range(kv_lo_ref[b, im] * rk, kv_hi_ref[b, im] * rk, q_start, bq, bk, st)
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]
    seg_q = segq_ref[...]

    def body(j, dq):
        k_start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(k_start, bk), :]
        v = v_ref[pl.ds(k_start, bk), :]
        seg_k = segk_ref[pl.ds(k_start, bk)]
        c, t = _scores(q, k, st)
        kind = kind_ref[b, im, j // rk]
        z = _masked_unless_full(kind, c, q_start, k_start, seg_q, seg_k, st)
        p = jnp.exp2(z - lse[:, None])
        dp = _dot(do, v, 1, 1)
        ds = p * (dp - delta[:, None])
        if t is not None:
            ds = ds * (1.0 - t * t)
        return dq + _dot(ds.astype(k.dtype), k, 1, 0)

    dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


# ---------------------------------------------------------------------------
# dK/dV kernel: grid (B, KV, Tp / bk); loops over (group head g, q tile) pairs.
# ---------------------------------------------------------------------------
def _dkdv_kernel(q_lo_ref, q_hi_ref, kind_ref, segq_ref, segk_ref,
                 q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
                 *, st: _Static, cfg: BlockConfig, groups: int, head_dim: int, tp: int):
    b, j = pl.program_id(0), pl.program_id(2)
    bq, bk = cfg.block_q, cfg.block_k
    rq, rk = st.meta_block_q // bq, st.meta_block_k // bk
    jm = j // rk
    k_start = j * bk
    lo, hi = _tile_q_range(q_lo_ref[b, jm] * rq, q_hi_ref[b, jm] * rq, k_start, bq, bk, st)
    cnt = hi - lo
    k = k_ref[...]
    v = v_ref[...]
    seg_k = segk_ref[...]
    d = head_dim

    def body(it, carry):
        dk, dv = carry
        g = it // cnt
        iq = lo + it % cnt
        q_start = pl.multiple_of(iq * bq, bq)
        col = pl.multiple_of(g * d, d)
        q = q_ref[pl.ds(q_start, bq), pl.ds(col, d)]
        do = do_ref[pl.ds(q_start, bq), pl.ds(col, d)]
        row = pl.multiple_of(g * tp + q_start, bq)
        lse = lse_ref[pl.ds(row, bq)]
        delta = delta_ref[pl.ds(row, bq)]
        seg_q = segq_ref[pl.ds(q_start, bq)]
        c, t = _scores(q, k, st)
        kind = kind_ref[b, iq // rq, jm]
        z = _masked_unless_full(kind, c, q_start, k_start, seg_q, seg_k, st)
        p = jnp.exp2(z - lse[:, None])
        dv = dv + _dot(p.astype(do.dtype), do, 0, 0)
        dp = _dot(do, v, 1, 1)
        ds = p * (dp - delta[:, None])
        if t is not None:
            ds = ds * (1.0 - t * t)
        dk = dk + _dot(ds.astype(q.dtype), q, 0, 0)
        return dk, dv

    zeros = jnp.zeros((bk, d), jnp.float32)
    dk, dv = lax.fori_loop(0, groups * cnt, body, (zeros, zeros))
    dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _flash_bwd(st: _Static, q, k, v, sinks, meta, o, lse, do):
    seg, kind, kv_lo, kv_hi, q_lo, q_hi = meta
    b, tp, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    whole = pl.no_block_spec
    # delta_i = dO_i . O_i, [B, H, Tp] fp32.
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))

    cq = st.config.dq
    bq = cq.block_q
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, st=st, cfg=cq),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(b, h, tp // bq),
        in_specs=[
            whole, whole, whole,
            pl.BlockSpec((None, bq), lambda bi, hi, i: (bi, i)),
            pl.BlockSpec((None, tp), lambda bi, hi, i: (bi, 0)),
            pl.BlockSpec((None, bq, None, d), lambda bi, hi, i: (bi, i, hi, 0)),
            pl.BlockSpec((None, tp, None, d), lambda bi, hi, i: (bi, 0, hi // g, 0)),
            pl.BlockSpec((None, tp, None, d), lambda bi, hi, i: (bi, 0, hi // g, 0)),
            pl.BlockSpec((None, bq, None, d), lambda bi, hi, i: (bi, i, hi, 0)),
            pl.BlockSpec((None, None, bq), lambda bi, hi, i: (bi, hi, i)),
            pl.BlockSpec((None, None, bq), lambda bi, hi, i: (bi, hi, i)),
        ],
        out_specs=pl.BlockSpec((None, bq, None, d), lambda bi, hi, i: (bi, i, hi, 0)),
        compiler_params=plgpu.CompilerParams(num_warps=cq.num_warps, num_stages=cq.num_stages),
        interpret=st.interpret,
        name=DQ_NAME,
    )(kv_lo, kv_hi, kind, seg, seg, q, k, v, do, lse, delta)

    ck = st.config.dkdv
    bk = ck.block_k
    # Free reshapes: heads of one KV group are adjacent (h = kv*G + g).
    q_g = q.reshape(b, tp, kvh, g * d)
    do_g = do.reshape(b, tp, kvh, g * d)
    lse_g = lse.reshape(b, kvh, g * tp)
    delta_g = delta.reshape(b, kvh, g * tp)
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, st=st, cfg=ck, groups=g, head_dim=d, tp=tp),
        out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        grid=(b, kvh, tp // bk),
        in_specs=[
            whole, whole, whole,
            pl.BlockSpec((None, tp), lambda bi, ki, j: (bi, 0)),
            pl.BlockSpec((None, bk), lambda bi, ki, j: (bi, j)),
            pl.BlockSpec((None, tp, None, g * d), lambda bi, ki, j: (bi, 0, ki, 0)),
            pl.BlockSpec((None, bk, None, d), lambda bi, ki, j: (bi, j, ki, 0)),
            pl.BlockSpec((None, bk, None, d), lambda bi, ki, j: (bi, j, ki, 0)),
            pl.BlockSpec((None, tp, None, g * d), lambda bi, ki, j: (bi, 0, ki, 0)),
            pl.BlockSpec((None, None, g * tp), lambda bi, ki, j: (bi, ki, 0)),
            pl.BlockSpec((None, None, g * tp), lambda bi, ki, j: (bi, ki, 0)),
        ],
        out_specs=(
            pl.BlockSpec((None, bk, None, d), lambda bi, ki, j: (bi, j, ki, 0)),
            pl.BlockSpec((None, bk, None, d), lambda bi, ki, j: (bi, j, ki, 0)),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=ck.num_warps, num_stages=ck.num_stages),
        interpret=st.interpret,
        name=DKDV_NAME,
    )(q_lo, q_hi, kind, seg, seg, q_g, k, v, do_g, lse_g, delta_g)

    if st.has_sinks:
        p_sink = jnp.exp2(sinks.astype(jnp.float32)[None, :, None] * LOG2E - lse)
        dsinks = -jnp.sum(p_sink * delta, axis=(0, 2)).astype(sinks.dtype)
    else:
        dsinks = jnp.zeros_like(sinks)
    return dq, dk, dv, dsinks


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, sinks, meta):
    return _flash_fwd(st, q, k, v, sinks, meta)[0]


def _flash_vjp_fwd(st, q, k, v, sinks, meta):
    # Named (residuals.py): a remat policy that keeps attn_out/attn_lse never re-runs this forward kernel.
    o, lse = _flash_fwd(st, q, k, v, sinks, meta)
    o, lse = name_output(o), name_stats(lse)
    return o, (q, k, v, sinks, meta, o, lse)


def _flash_vjp_bwd(st, res, do):
    q, k, v, sinks, meta, o, lse = res
    dq, dk, dv, dsinks = _flash_bwd(st, q, k, v, sinks, meta, o, lse, do)
    return dq, dk, dv, dsinks, tuple(None for _ in meta)


_flash.defvjp(_flash_vjp_fwd, _flash_vjp_bwd)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    metadata: AttentionMetadata,
    *,
    segment_ids: jax.Array | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
    scale: float | None = None,
    config: FlashConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Flash attention with a custom VJP; semantics of ``reference.attention_reference``.

    The mask comes from ``metadata`` (its padded segment ids); ``segment_ids``
    is accepted for signature symmetry and ignored.  ``config`` defaults to
    ``config.default_flash_config(D)``, clamped to the metadata blocks.
    ``interpret`` defaults to True off-GPU.
    """
    del segment_ids
    t, d = q.shape[1], q.shape[3]
    st = _static(metadata, t, d, causal, sliding_window, logit_softcap, scale, sinks is not None, config, interpret)
    sinks_arr = jnp.zeros((q.shape[2],), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    out = _flash(st, *_pad_time((q, k, v), metadata.padded_len), sinks_arr, metadata_arrays(metadata))
    return out[:, :t]


def _static(metadata, t, d, causal, sliding_window, logit_softcap, scale, has_sinks, config, interpret) -> _Static:
    check_compatible(metadata, t, causal, sliding_window, _WHERE)
    if config is None:
        config = default_flash_config(d)
    config = fit_to_metadata(config, metadata.block_q, metadata.block_k)
    if interpret is None:
        interpret = target_platform() != "gpu"
    return _Static(
        causal=bool(causal),
        sliding_window=sliding_window,
        logit_softcap=None if logit_softcap is None else float(logit_softcap),
        scale=float(d ** -0.5 if scale is None else scale),
        has_sinks=bool(has_sinks),
        meta_block_q=metadata.block_q,
        meta_block_k=metadata.block_k,
        config=config,
        interpret=bool(interpret),
    )


def metadata_arrays(metadata: AttentionMetadata) -> tuple:
    """The metadata arrays the kernels read, in their argument order (a custom VJP's argument: arrays only)."""
    return (metadata.segment_ids, metadata.block_kind, metadata.kv_lo, metadata.kv_hi,
            metadata.q_lo, metadata.q_hi)


def _pad_time(xs, tp, value=0.0):
    """Pads axis 1 (time, [B, T, ...]) of each array to the metadata's padded length tp."""
    return tuple(jnp.pad(x, [(0, 0), (0, tp - x.shape[1])] + [(0, 0)] * (x.ndim - 2), constant_values=value)
                 for x in xs)


def flash_pair(metadata: AttentionMetadata, t: int, d: int, *, causal: bool = True,
               sliding_window: int | None = None, logit_softcap: float | None = None,
               scale: float | None = None, config: FlashConfig | None = None, interpret: bool | None = None):
    """(fwd_lse, bwd): the kernels without sinks and without the custom VJP, for `sinks.sink_attention`, on
    rows of length t and head dim d masked by ``metadata``; its arrays are an explicit last argument
    (`metadata_arrays`), so a custom VJP built on the pair closes over no traced value:

        fwd_lse(q, k, v, meta) -> (o [B, T, H, D], lse [B, H, T] fp32, natural log)
        bwd(q, k, v, o, lse, do, meta) -> (dq, dk, dv)

    The same statistics as cuDNN's (`cudnn.cudnn_pair`), so one residual slot serves either kernel (the
    device-side choice in `api.py`). The kernels keep a base-2 lse: lse2 = lse * log2 e. Padded query rows
    (t..Tp) get lse2 = +inf in the backward, so their probabilities exp2(z - lse2) are exactly 0 (with dO = 0
    there, a finite stand-in could make 0 * inf)."""
    st = _static(metadata, t, d, causal, sliding_window, logit_softcap, scale, False, config, interpret)
    tp = metadata.padded_len

    def fwd_lse(q, k, v, meta):
        o, lse2 = _flash_fwd(st, *_pad_time((q, k, v), tp), jnp.zeros((q.shape[2],), jnp.float32), meta)
        return o[:, :t], lse2[:, :, :t] * (1.0 / LOG2E)

    def bwd(q, k, v, o, lse, do, meta):
        lse2 = jnp.pad(lse * LOG2E, ((0, 0), (0, 0), (0, tp - t)), constant_values=jnp.inf)
        sinks = jnp.zeros((q.shape[2],), jnp.float32)
        dq, dk, dv, _ = _flash_bwd(st, *_pad_time((q, k, v), tp), sinks, meta, *_pad_time((o,), tp), lse2,
                                   *_pad_time((do,), tp))
        return dq[:, :t], dk[:, :t], dv[:, :t]

    return fwd_lse, bwd
