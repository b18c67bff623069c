"""Public attention entry point: ``dot_product_attention``, and the op's registry ``OP``.

Implementations (names as in ``kernels_pallas/_dispatch.py``): "reference" (``reference.py``, autodiff;
O(T^2) memory), "pallas" (flash kernels with a custom VJP, ``flash.py``), "cudnn" (``cudnn.py``).  There is
no "xla" custom-VJP implementation of attention: the spelling "xla" is an alias of "reference", kept because
``TrainConfig.attention_implementation`` and ``jaxft.from_pretrained(attention_impl="xla")`` accept it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas._dispatch import ALL_PLATFORMS, GPU_PLATFORMS, Implementation, Op
from kernels_pallas.attention.metadata import AttentionMetadata, check_compatible, make_metadata
from kernels_pallas.attention.reference import attention_reference
from kernels_pallas.attention.residuals import name_output, named_vjp
from kernels_pallas.attention.sinks import sink_attention

_WHERE = "kernels_pallas/attention/api.py"


def _run_reference(q, k, v, segment_ids, metadata, kwargs):
    # Plain autodiff: its backward needs the [T, T] probabilities, so keeping the named output alone does not
    # spare the recompute (the kernels' custom VJPs need only the output and the statistics).
    del metadata
    return name_output(attention_reference(q, k, v, segment_ids=segment_ids, **kwargs))


def _run_pallas(q, k, v, segment_ids, metadata, kwargs):
    from kernels_pallas.attention.flash import flash_attention

    if metadata is None:
        seg = segment_ids if segment_ids is not None else jnp.ones(q.shape[:2], jnp.int32)
        metadata = make_metadata(seg, causal=kwargs["causal"], sliding_window=kwargs["sliding_window"])
    return flash_attention(q, k, v, metadata, segment_ids=segment_ids, **kwargs)


def _run_cudnn(q, k, v, segment_ids, metadata, kwargs):
    del metadata
    from kernels_pallas.attention.cudnn import cudnn_attention

    if kwargs["sinks"] is not None:  # sinks.sink_attention's VJP names its residuals and differentiates sinks
        return cudnn_attention(q, k, v, segment_ids=segment_ids, **kwargs)
    # JAX's cuDNN VJP keeps its residuals unnamed; named_vjp names them so remat policies can keep them.
    if segment_ids is None:
        return named_vjp(lambda q, k, v: cudnn_attention(q, k, v, **kwargs))(q, k, v)
    return named_vjp(lambda q, k, v, seg: cudnn_attention(q, k, v, segment_ids=seg, **kwargs))(q, k, v, segment_ids)


OP = Op(
    name="attention",
    where=_WHERE,
    implementations=(
        Implementation("reference", _run_reference, ALL_PLATFORMS, summary="masked softmax, [T, T] scores"),
        Implementation("pallas", _run_pallas, GPU_PLATFORMS, interpret_platforms=("cpu",),
                       summary="flash kernels (Triton), block-skipping metadata, custom VJP"),
        Implementation("cudnn", _run_cudnn, GPU_PLATFORMS, summary="cuDNN fused attention"),
    ),
    # Device-level order only; on a GPU `auto` is refined per call by config.choose_implementation.
    auto_order=("pallas", "reference"),
    aliases={"xla": "reference"},
)
IMPLEMENTATIONS = OP.accepted


def _validate(q, k, v, segment_ids, sinks, sliding_window, logit_softcap):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"{_WHERE}: q, k, v must be [B,T,H,D], [B,T,KV,D], [B,T,KV,D]; got "
            f"{q.shape}, {k.shape}, {v.shape}."
        )
    b, t, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[1] != t or k.shape[3] != d:
        raise ValueError(
            f"{_WHERE}: k {k.shape} and v {v.shape} must equal [B={b}, T={t}, KV, D={d}] "
            "(self-attention over the same packed sequence)."
        )
    if h % k.shape[2] != 0:
        raise ValueError(f"{_WHERE}: num q heads {h} must be a multiple of num kv heads {k.shape[2]}.")
    if segment_ids is not None and tuple(segment_ids.shape) != (b, t):
        raise ValueError(f"{_WHERE}: segment_ids shape {segment_ids.shape} must be [B, T] = {(b, t)}.")
    if sinks is not None and tuple(sinks.shape) != (h,):
        raise ValueError(f"{_WHERE}: sinks shape {sinks.shape} must be [H] = ({h},).")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{_WHERE}: sliding_window={sliding_window!r} must be None or an int >= 1.")
    if logit_softcap is not None and not float(logit_softcap) > 0:
        raise ValueError(f"{_WHERE}: logit_softcap={logit_softcap!r} must be None or > 0.")


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    metadata: AttentionMetadata | None = None,
    causal: bool = True,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: jax.Array | None = None,
    scale: float | None = None,
    implementation: str | None = "reference",
) -> jax.Array:
    """Multi-head attention over packed rows. Returns [B,T,H,D] in q.dtype.

    q [B,T,H,D]; k, v [B,T,KV,D] with H % KV == 0 (GQA/MQA; K/V never repeated).
    Key u is kept for query t iff seg[t] == seg[u] and (not causal or u <= t)
    and (sliding_window is None or t - u < sliding_window).  Scores are
    scale * q.k (scale defaults to D**-0.5), soft-capped as
    cap * tanh(s / cap) when ``logit_softcap``, then masked; ``sinks`` [H]
    adds one extra logit per head to the softmax whose probability is dropped.

    ``metadata`` (from ``make_metadata``) is used by the kernels; when given
    without ``segment_ids`` its segment ids are used.  implementation:
    "reference" (pure JAX, autodiff; "xla" is an old alias of it), "pallas"
    (flash kernels; interpret mode off-GPU), "cudnn" (cuDNN), "auto" or None
    (per call: the fastest measured implementation that supports the
    features, config.choose_implementation).
    """
    requested = OP.canonical(implementation)
    _validate(q, k, v, segment_ids, sinks, sliding_window, logit_softcap)
    t = q.shape[1]
    if metadata is not None:
        check_compatible(metadata, t, causal, sliding_window, _WHERE)
        if segment_ids is None:
            segment_ids = metadata.segment_ids[:, :t]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    kwargs = dict(causal=causal, sliding_window=sliding_window,
                  logit_softcap=logit_softcap, sinks=sinks, scale=float(scale))
    if requested == "auto":
        from kernels_pallas.attention.config import choose_implementation

        requested = choose_implementation(
            q.shape, k.shape, q.dtype, segment_ids is not None, **kwargs
        )
        dense_impl = choose_implementation(q.shape, k.shape, q.dtype, False, **kwargs)
        if requested == "pallas" and metadata is not None and dense_impl == "cudnn":
            # Packed rows go to the block-skipping Pallas kernel, but a batch whose rows are each one
            # segment is plain causal attention, where cuDNN's dense kernel is ~2x faster (measured,
            # config.MEASURED_FASTEST). `single_segment` is computed once per batch in the metadata;
            # the choice is made on the device, so one compiled step serves both kinds of batch.
            return _dense_or_packed(q, k, v, metadata, segment_ids, kwargs)
    impl = OP.resolve(requested)
    return impl.fn(q, k, v, segment_ids, metadata, kwargs)


def _dense_or_packed(q, k, v, metadata, segment_ids, kwargs):
    from kernels_pallas.attention.cudnn import cudnn_pair
    from kernels_pallas.attention.flash import flash_pair, metadata_arrays

    del segment_ids  # the flash kernels read the metadata's (padded) segment ids
    static = dict(causal=kwargs["causal"], sliding_window=kwargs["sliding_window"], scale=kwargs["scale"])
    dense = cudnn_pair(**static)
    packed = flash_pair(metadata, q.shape[1], q.shape[3], logit_softcap=kwargs["logit_softcap"], **static)
    fwd_lse, bwd = dense_or_packed_pair(dense, packed)
    return sink_attention(fwd_lse, bwd)(q, k, v, kwargs["sinks"], metadata.single_segment,
                                        metadata_arrays(metadata))


def dense_or_packed_pair(dense, packed):
    """One (fwd_lse, bwd) pair (sinks.sink_attention) that runs `dense` when its predicate is true and `packed`
    otherwise, chosen on the device: fwd_lse(q, k, v, pred, meta), bwd(q, k, v, o, lse, do, pred, meta).
    `dense` takes no metadata, `packed` takes `meta` last. Both must return the output and a [B, H, T] fp32
    natural-log lse, so the two branches fill the same two residual slots.

    Why a pair and not `lax.cond` over two attention functions: differentiating such a cond gives each branch
    its own residuals (the other branch's filled with zeros), named inside the branch. A remat policy that
    offloads the named residuals then puts one branch's outputs in host memory and not the other's, and XLA's
    GPU layout assignment rejects the conditional (seen on the H200: "Expected instruction to have shape
    equal to ... S(5)" at 8B packed 16k with offload_all). Here the cond returns (o, lse) from either kernel,
    the names are put on the cond's results outside it, and the backward is one more cond on the same
    predicate, so the kept residuals are half as many and every branch agrees on where they live."""
    (dense_fwd, dense_bwd), (packed_fwd, packed_bwd) = dense, packed

    def fwd_lse(q, k, v, pred, meta):
        return jax.lax.cond(pred, lambda q, k, v, meta: dense_fwd(q, k, v), packed_fwd, q, k, v, meta)

    def bwd(q, k, v, o, lse, do, pred, meta):
        return jax.lax.cond(pred, lambda *a: dense_bwd(*a[:-1]), packed_bwd, q, k, v, o, lse, do, meta)

    return fwd_lse, bwd
