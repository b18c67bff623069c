"""The parts a family assembles its decoder layer from: RMSNorm (plain or offset), GLU activations, the
attention block, the MLP slot, and the block that wires them with residuals.

A family (`jaxft.families`) says which parts it uses through `BlockParts`; sizes, biases, q/k norm,
softcaps and windows come from its `ModelConfig`. Every module is created with stacked parameters (a leading
layer axis, `stack=(L,)`) and called on one layer's slice (see `jaxft.models.layers`).

Math of one block (x: the residual stream [B, T, H]):
    plain (Llama/Qwen/Mistral):  h = x + attn(n1(x));           y = h + mlp(n2(h))
    sandwich (Gemma 2/3):        h = x + n1o(attn(n1(x)));      y = h + n2o(mlp(n2(h)))
    attn:  q, k, v = x Wq, x Wk, x Wv  ->  (q/k norm)  ->  RoPE  ->  softmax(softcap(scale q.k) + mask) v  -> Wo
    mlp ("glu" slot):  down(act(gate(x)) * up(x)),  act = silu (SwiGLU) or tanh-approximated gelu (GeGLU)
    RMSNorm:  plain  w * (x32 * rsqrt(mean(x32^2) + eps)).astype(dtype)        (Llama: product in dtype)
              offset (x32 * rsqrt(mean(x32^2) + eps) * (1 + w32)).astype(dtype)  (Gemma: weights are offsets)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxft.config import ModelConfig
from jaxft.families.family import BlockParts
from jaxft.models.activations import ACTIVATIONS
from jaxft.models.gpt_oss_moe import GptOssMoeMLP
from jaxft.models.layers import Linear, _init, _recompute, logical, project, stack_axes
from jaxft.models.moe import MoeMLP
from jaxft.models.rope import apply_rope
from jaxft.residuals import ATTN_PROJ, ATTN_QKV, MLP_GATE_UP, MLP_INPUT, MLP_OUT
from kernels_pallas.rmsnorm import rmsnorm


# ------------------------------------------------------------------------------------------------ norms


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis with fp32 statistics and the result in x's dtype, as transformers.

    `offset=False`: w * x_hat.astype(dtype) (Llama/Qwen/Mistral; custom-VJP kernel). `offset=True`:
    (x_hat * (1 + w)).astype(dtype) with the product in fp32 (Gemma, whose stored weights start at 0)."""

    def __init__(self, dim: int, *, eps: float, stack: tuple[int, ...], dtype, offset: bool = False):
        self.scale = nnx.Param((jnp.zeros if offset else jnp.ones)((*stack, dim), dtype),
                               **logical(*stack_axes(stack), "norm"))
        self.eps = eps
        self.offset = offset

    @jax.named_scope("rmsnorm")
    def __call__(self, x: jax.Array) -> jax.Array:
        # Custom VJP: the backward keeps x in its own dtype and one fp32 scalar per row, not fp32 copies.
        return rmsnorm(x, self.scale[...], self.eps, offset=self.offset)


# ------------------------------------------------------------------------------------------------ attention


class Attention(nnx.Module):
    """q/k/v/o projections, optional per-head q/k RMSNorm (Qwen3, Gemma 3) and RoPE. The attention op itself
    (mask, window, scale, softcap) is `ctx["attend"]`, built once per layer group by the decoder."""

    def __init__(self, cfg: ModelConfig, *, stack, dtype, rngs, norm_offset: bool = False):
        h, d = cfg.hidden_size, cfg.head_dim
        lin = dict(stack=stack, dtype=dtype, rngs=rngs)
        self.q_proj = Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias, axes=("embed", "heads"), **lin)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, axes=("embed", "kv_heads"), **lin)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, axes=("embed", "kv_heads"), **lin)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=cfg.o_bias, axes=("heads", "embed"), **lin)
        if cfg.qk_norm:
            norm = dict(eps=cfg.rms_norm_eps, stack=stack, dtype=dtype, offset=norm_offset)
            self.q_norm, self.k_norm = RMSNorm(d, **norm), RMSNorm(d, **norm)
        else:
            self.q_norm = self.k_norm = None
        # GPT-OSS: one learned logit per head joined to the softmax denominator (its probability is dropped).
        self.sinks = (nnx.Param(_init(rngs, (*stack, cfg.num_heads), dtype, 0.02),
                                **logical(*stack_axes(stack), "heads")) if cfg.attention_sinks else None)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d

    def sink_kwargs(self) -> dict[str, Any]:
        """{"sinks": this layer's [H] sink logits} for the attention op, or {} without sinks."""
        return {} if self.sinks is None else {"sinks": self.sinks[...]}

    def project(self, x, rngs: tuple) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B,T,H,D], k, v [B,T,KV,D] from normed hidden states (before q/k norm and RoPE)."""
        b, t, _ = x.shape
        q, k, v = project((self.q_proj, self.k_proj, self.v_proj), x, rngs[:3])
        return (q.reshape(b, t, self.num_heads, self.head_dim), k.reshape(b, t, self.num_kv_heads, self.head_dim),
                v.reshape(b, t, self.num_kv_heads, self.head_dim))

    def rotate(self, q, k, ctx: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
        """(q/k norm and) RoPE with the tables ctx["cos"], ctx["sin"]: what attention sees of q and k."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        with jax.named_scope("rope"):
            q = apply_rope(q, ctx["cos"], ctx["sin"])
            k = apply_rope(k, ctx["cos"], ctx["sin"])
        return q, k

    def attend(self, q, k, v, ctx: dict[str, Any]) -> jax.Array:
        """(q/k norm,) RoPE and attention: [B,T,H,D]. The attention ops name their output and softmax
        statistics themselves (`kernels_pallas.attention.residuals`); what they read is named here."""
        q, k = self.rotate(q, k, ctx)
        q, k, v = (checkpoint_name(a, ATTN_QKV) for a in (q, k, v))
        with jax.named_scope("attention"):
            return ctx["attend"](q, k, v, **self.sink_kwargs())

    def output(self, o, rngs: tuple) -> jax.Array:
        b, t = o.shape[:2]
        return self.o_proj(o.reshape(b, t, self.num_heads * self.head_dim), rngs[3])


# ------------------------------------------------------------------------------------------------ MLP slot


class GluMLP(nnx.Module):
    """down(act(gate(x)) * up(x)): the dense gated MLP.

    The MLP slot's interface is `branch(norm, h, rngs, prevent_cse)` (training: the MLP of norm(h), with the
    elementwise inputs of its LoRA'd linears recomputed in the backward pass) and `infer(x)` (no backward).
    A mixture-of-experts MLP implements the same two methods and registers in `MLPS`."""

    NUM_LINEARS = 3  # dropout keys the block hands over: gate, up, down

    def __init__(self, cfg: ModelConfig, *, stack, dtype, rngs):
        lin = dict(bias=cfg.mlp_bias, stack=stack, dtype=dtype, rngs=rngs)
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, axes=("embed", "mlp"), **lin)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, axes=("embed", "mlp"), **lin)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, axes=("mlp", "embed"), **lin)
        self.hidden_act = cfg.hidden_act  # a name (static), looked up in ACTIVATIONS

    def gate_up(self, x, rngs: tuple) -> tuple[jax.Array, jax.Array]:
        return tuple(project((self.gate_proj, self.up_proj), x, rngs[:2]))

    def act_down(self, gate, up, rngs: tuple) -> jax.Array:
        with jax.named_scope("glu"):
            h = ACTIVATIONS[self.hidden_act](gate, up)
        return self.down_proj(h, rngs[2])

    def branch(self, norm, h, rngs: tuple, prevent_cse: bool) -> jax.Array:
        gate, up = _recompute(lambda h: self.gate_up(norm(h), rngs), prevent_cse)(h)
        gate, up = checkpoint_name(gate, MLP_GATE_UP), checkpoint_name(up, MLP_GATE_UP)
        return _recompute(lambda g, u: self.act_down(g, u, rngs), prevent_cse)(gate, up)

    def infer(self, x) -> jax.Array:
        none = (None,) * self.NUM_LINEARS
        return self.act_down(*self.gate_up(x, none), none)


MLPS: dict[str, type] = {"glu": GluMLP, "moe": MoeMLP, "gpt_oss_moe": GptOssMoeMLP}


def tiled_mlp(branch, h, rngs: tuple, chunk: int | None, prevent_cse: bool) -> jax.Array:
    """`branch(h, rngs)` (the MLP slot of a [B, T, H] input) evaluated over sequence chunks of `chunk` tokens.

    The MLP acts on each token alone, so the chunks' outputs concatenated are the untiled output (up to the
    matmuls' rounding on smaller operands). Each chunk runs under a save-nothing checkpoint inside a
    `lax.map`: the forward keeps only the chunks' inputs (slices of h), the backward recomputes one chunk's
    [chunk, intermediate] activations at a time, so no layer ever holds [T, intermediate] tensors. T is padded
    to a multiple of `chunk` with zero rows whose outputs are dropped (their gradient is zero). With LoRA
    dropout each chunk folds its index into the dropout keys (other masks than untiled, same distribution).
    `chunk` None, or >= T: one plain call."""
    b, t, width = h.shape
    if chunk is None or chunk >= t:
        return branch(h, rngs)
    n = -(-t // chunk)
    padded = jnp.pad(h, ((0, 0), (0, n * chunk - t), (0, 0)))
    chunks = padded.reshape(b, n, chunk, width).swapaxes(0, 1)

    def one(args):
        hc, index = args
        keys = tuple(None if r is None else jax.random.fold_in(r, index) for r in rngs)
        return branch(hc, keys)

    body = jax.checkpoint(one, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=prevent_cse)
    with jax.named_scope("tiled_mlp"):
        out = jax.lax.map(body, (chunks, jnp.arange(n, dtype=jnp.int32)))
    return out.swapaxes(0, 1).reshape(b, n * chunk, -1)[:, :t]


# ------------------------------------------------------------------------------------------------ the block


class DecoderLayer(nnx.Module):
    """One decoder layer assembled from `parts`: pre-norms, attention, MLP slot and (sandwich) output norms.

    Norm names: `input_norm` before attention; `post_attn_norm` on the residual before the MLP (HF Llama's
    post_attention_layernorm, Gemma's pre_feedforward_layernorm); with sandwich norms also `attn_out_norm`
    on the attention output (Gemma's post_attention_layernorm) and `mlp_out_norm` on the MLP output."""

    def __init__(self, cfg: ModelConfig, *, stack, dtype, rngs, parts: BlockParts = BlockParts()):
        if parts.mlp not in MLPS:
            raise ValueError(f"BlockParts.mlp={parts.mlp!r} is not a registered MLP; known: {', '.join(MLPS)}")
        norm = dict(eps=cfg.rms_norm_eps, stack=stack, dtype=dtype, offset=parts.norm_offset)
        self.input_norm = RMSNorm(cfg.hidden_size, **norm)
        self.attn = Attention(cfg, stack=stack, dtype=dtype, rngs=rngs, norm_offset=parts.norm_offset)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, **norm)
        self.mlp = MLPS[parts.mlp](cfg, stack=stack, dtype=dtype, rngs=rngs)
        if parts.sandwich_norms:
            self.attn_out_norm = RMSNorm(cfg.hidden_size, **norm)
            self.mlp_out_norm = RMSNorm(cfg.hidden_size, **norm)
        else:
            self.attn_out_norm = self.mlp_out_norm = None

    def _out(self, norm, y):
        return y if norm is None else norm(y)

    def __call__(self, x, ctx: dict[str, Any], dropout_rng: jax.Array | None = None):
        n_mlp = self.mlp.NUM_LINEARS
        # One dropout key per LoRA'd linear: q, k, v, o, then the MLP's.
        keys = (None,) * (4 + n_mlp) if dropout_rng is None else tuple(jax.random.split(dropout_rng, 4 + n_mlp))
        ra, rm = keys[:4], keys[4:]
        # Same math as x + attn(norm(x)); h + mlp(norm(h)), with the elementwise inputs of LoRA'd linears
        # (normed states, o reshaped, act(gate) * up) recomputed in the backward pass instead of kept.
        pc = bool(ctx.get("prevent_cse", False))
        q, k, v = _recompute(lambda x: self.attn.project(self.input_norm(x), ra), pc)(x)
        attn = _recompute(lambda o: self.attn.output(o, ra), pc)(self.attn.attend(q, k, v, ctx))
        attn = checkpoint_name(attn, ATTN_PROJ)  # kept only where an output norm's backward reads it
        h = checkpoint_name(x + self._out(self.attn_out_norm, attn), MLP_INPUT)
        token_weights = ctx.get("router_token_weights")
        # A sparse layer's context names the grouped-matmul implementation of its experts (the decoder's group_ctx).
        gmm = ({} if "grouped_matmul_implementation" not in ctx
               else {"gmm_implementation": ctx["grouped_matmul_implementation"], "dispatch": ctx["moe_dispatch"]})
        if token_weights is None:
            mlp = tiled_mlp(lambda h, r: self.mlp.branch(self.post_attn_norm, h, r, pc, **gmm), h, rm,
                            ctx.get("mlp_chunk_size"), pc)
            return h + self._out(self.mlp_out_norm, checkpoint_name(mlp, MLP_OUT))
        # Router statistics requested (the load-balancing loss): (x, [2, E] stats of this layer's router).
        if ctx.get("mlp_chunk_size") is not None:
            raise ValueError("mlp_chunk_size with the router load-balancing loss (output_router_logits) is not "
                             "supported yet; set mlp_chunk_size to null")
        y, stats = self.mlp.branch(self.post_attn_norm, h, rm, pc, token_weights, **gmm)
        return h + self._out(self.mlp_out_norm, checkpoint_name(y, MLP_OUT)), stats

    def cached(self, x, ctx: dict[str, Any], cache):
        """Inference forward of new tokens x [B,T,H] against a KV cache: `(x, cache)`.

        The same modules and math as `__call__` (no dropout, nothing to recompute without a backward pass);
        attention is `ctx["attend_cached"](q, k, v, cache) -> (o, cache)`, which stores the new tokens'
        rotated k/v in the cache and attends over it (see `jaxft.generation.kv_cache`).
        """
        none = (None,) * 4
        q, k, v = self.attn.project(self.input_norm(x), none)
        q, k = self.attn.rotate(q, k, ctx)
        with jax.named_scope("attention"):
            o, cache = ctx["attend_cached"](q, k, v, cache, **self.attn.sink_kwargs())
        h = x + self._out(self.attn_out_norm, self.attn.output(o, none))
        return h + self._out(self.mlp_out_norm, self.mlp.infer(self.post_attn_norm(h))), cache
