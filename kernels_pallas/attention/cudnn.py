"""cuDNN flash attention through JAX (``implementation="cudnn"``).

Dense rows use the public ``jax.nn.dot_product_attention(implementation="cudnn")``.
Packed rows use cuDNN's ragged ("THD") layout, reachable in jax 0.11 only
through ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` with
``q_offsets``/``kv_offsets`` [B, M+1] and ``q_seqlen``/``kv_seqlen`` [B, M]
(M = max segments per row, unused slots -1).  Each maximal run of equal
segment ids is one cuDNN sequence (the padding run too, matching the contract
that padding attends among itself), so segments must be contiguous runs.
Sinks (GPT-OSS) on dense rows: ``cudnn_pair`` gives cuDNN's forward with its softmax statistics (the
log-sum-exp) and its backward kernel fed another output and output gradient, which ``sinks.sink_attention``
turns into the exact attention with sinks (sinks.py has the algebra). The backward is reached through
``fused_attention_stablehlo._dot_product_attention_bwd_rule`` (jax 0.11), the rule JAX's own VJP runs.
Not supported by cuDNN here: logit soft-capping, sinks on packed rows, non-causal windows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_WHERE = "kernels_pallas/attention/cudnn.py"


def segment_runs(segment_ids: jax.Array, max_segments: int):
    """Offsets [B, M+1] and lengths [B, M] of the runs of equal ids (-1 padded).

    Rows with more than ``max_segments`` runs would be silently truncated by
    cuDNN; callers that cannot bound the count should pass M = T.
    """
    b, t = segment_ids.shape
    starts = jnp.concatenate(
        [jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )

    def row(s):
        idx = jnp.nonzero(s, size=max_segments + 1, fill_value=-1)[0].astype(jnp.int32)
        nxt = jnp.concatenate([idx[1:], jnp.array([-1], jnp.int32)])
        nxt = jnp.where((nxt < 0) & (idx >= 0), t, nxt)
        lens = jnp.where(idx >= 0, nxt - idx, -1)
        offsets = idx.at[max_segments].set(-1)
        return offsets, lens[:max_segments]

    return jax.vmap(row)(starts)


def cudnn_attention(
    q, k, v, *, segment_ids=None, causal=True, sliding_window=None,
    logit_softcap=None, sinks=None, scale=None, max_segments: int | None = None,
):
    """Attention on cuDNN; same semantics as ``reference.attention_reference``."""
    if logit_softcap is not None or (sinks is not None and segment_ids is not None):
        raise ValueError(
            f"{_WHERE}: cuDNN attention supports neither logit_softcap nor sinks on packed rows; "
            "use implementation='pallas' or 'reference'."
        )
    if sliding_window is not None and not causal:
        raise ValueError(f"{_WHERE}: cuDNN sliding windows need causal=True; use 'pallas' or 'reference'.")
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"{_WHERE}: cuDNN flash attention needs bf16/fp16 inputs, got {q.dtype}.")
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    if sinks is not None:
        from kernels_pallas.attention.sinks import sink_attention

        return sink_attention(*cudnn_pair(causal=causal, sliding_window=sliding_window, scale=scale))(q, k, v, sinks)
    if segment_ids is None:
        window = None if sliding_window is None else (sliding_window - 1, 0)
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, local_window_size=window,
            implementation="cudnn",
        )
    from jax._src.cudnn import fused_attention_stablehlo as fa

    t = q.shape[1]
    m = t if max_segments is None else int(max_segments)
    offsets, lens = segment_runs(segment_ids.astype(jnp.int32), m)
    mask_type = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
    return fa.dot_product_attention(
        q, k, v, q_seqlen=lens, kv_seqlen=lens, q_offsets=offsets, kv_offsets=offsets,
        scale=scale, mask_type=mask_type, sliding_window_length=sliding_window,
    )


def cudnn_pair(*, causal: bool, sliding_window: int | None, scale: float):
    """(fwd_lse, bwd) of cuDNN attention on dense rows [B, T, H, D] for ``sinks.sink_attention``: the forward
    returns (o, lse [B, H, T] fp32: cuDNN's softmax statistics, the natural-log log-sum-exp of the scaled
    scores); the backward runs cuDNN's backward kernel on a given output and output gradient with that lse."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    mask_type = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    layout = fa._normalize_layout("BTNH").value

    def fwd_lse(q, k, v):
        return fa.dot_product_attention(q, k, v, scale=scale, mask_type=mask_type,
                                        sliding_window_length=sliding_window, return_residual=True)

    def bwd(q, k, v, o, lse, do):
        unused = jnp.zeros(0, q.dtype)
        # The residuals in the order fa._dot_product_attention's forward rule saves them: q, k, v, bias,
        # q/kv seqlens, q/kv offsets, page tables (all unused here), the statistics, the output.
        res = (q, k, v) + (unused,) * 7 + (lse, o)
        grads = fa._dot_product_attention_bwd_rule(scale, 42, 0.0, (False, False), mask_type, layout,
                                                  sliding_window, fa.check_cudnn_version(), False, res, do)
        return grads[0], grads[1], grads[2]

    return fwd_lse, bwd
