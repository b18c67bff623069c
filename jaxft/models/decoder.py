"""The causal LM: embeddings, the layer stack of a family's blocks, final norm and LM head.

Data flow of a forward pass:
    batch-level, computed ONCE:  positions (derived from segment_ids when absent), cos/sin tables per RoPE
                                 kind in use, attention block metadata per distinct window
    embed (x sqrt(H) for Gemma; or `inputs_embeds`)
          -> layer groups (`jaxft.models.stack`), each scanned or unrolled over its slice of the stacked
             layers [family block: norm -> q,k,v (+LoRA) -> (q/k norm) -> RoPE -> attention(window, scale,
             softcap) -> o -> (norm) -> residual -> norm -> MLP slot (+LoRA) -> (norm) -> residual]
          -> final norm -> lm_head (or tied embedding) -> (final logit softcap)
The family (`jaxft.families`, chosen by `model_type`) decides the block's parts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxft.config import SPARSE_MLPS, ModelConfig
from jaxft.memory.execution import ExecutionConfig
from jaxft.families import family_for
from jaxft.mesh_axes import row_split
from jaxft.models.layers import Linear, TrainableParam, _init, logical, with_token_rows
from jaxft.models.parts import DecoderLayer, RMSNorm
from jaxft.models.rope import mrope_tables, rope_tables
from jaxft.models.stack import _layer_runs, is_unstacked, layer_groups, layer_slice, layer_stacks, run_groups, STACK_NAMES
from kernels_pallas import attention as attention_ops

__all__ = ["DEFAULT_EXECUTION", "Decoder", "_layer_runs", "abstract_model", "init_model", "is_unstacked",
           "layer_slice", "model_class", "positions_from_segments", "softcap"]

# A plain forward pass: the reference attention and no rematerialisation (what tests and exports use).
DEFAULT_EXECUTION = ExecutionConfig(attention_implementation="reference", remat="none")


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
    """Position of each token inside its document: 0 at every segment start, +1 after."""
    t = segment_ids.shape[-1]
    idx = jnp.arange(t, dtype=jnp.int32)
    start = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    first = jax.lax.cummax(jnp.where(start, idx[None, :], 0), axis=1)
    return (idx[None, :] - first).astype(jnp.int32)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (identity when cap is None), in x's dtype."""
    if cap is None:
        return x
    return (jnp.tanh(x / cap) * cap).astype(x.dtype)


class Decoder(nnx.Module):
    """A causal LM. `model(input_ids, positions=None, segment_ids=None) -> logits [B, T, V]`."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        parts = family_for(cfg.model_type).parts
        self.embed_scale = parts.embed_scale
        self.embed = nnx.Module()
        self.embed.embedding = nnx.Param(_init(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, 0.02),
                                         **logical("vocab", "embed"))
        # One stack per MLP kind in use (`layer_stacks`): `layers` holds the family's own kind; Qwen3-MoE's dense
        # layers among the sparse ones are a second stack, `dense_layers` (None when there are none).
        stacks = layer_stacks(cfg)
        for name in STACK_NAMES:
            rows = stacks.get(name)
            setattr(self, name, None if rows is None else DecoderLayer(
                cfg, stack=(len(rows),), dtype=dtype, rngs=rngs, parts=dataclasses.replace(parts, mlp=cfg.layer_mlps[rows[0]])))
        self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, stack=(), dtype=dtype,
                                  offset=parts.norm_offset)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        Linear(cfg.hidden_size, cfg.vocab_size, bias=False, stack=(), dtype=dtype, rngs=rngs,
                               axes=("embed", "vocab")))

    # ---------------------------------------------------------------- batch-level metadata (once per step)
    def batch_context(self, input_ids, positions=None, segment_ids=None,
                      execution: ExecutionConfig = DEFAULT_EXECUTION, *, shape=None) -> dict[str, Any]:
        """Everything every layer needs that depends only on the batch: built once, outside the layer loop.

        `shape` ([B, T]) stands in for `input_ids` when the model is fed `inputs_embeds`."""
        with jax.named_scope("batch_context"):
            return self._batch_context(input_ids, positions, segment_ids, execution, shape)

    def _batch_context(self, input_ids, positions, segment_ids, execution, shape) -> dict[str, Any]:
        cfg = self.config
        if input_ids is not None:
            input_ids = jnp.asarray(input_ids, jnp.int32)
            shape = input_ids.shape
        if segment_ids is not None:
            segment_ids = jnp.asarray(segment_ids, jnp.int32)
        if positions is None:
            if segment_ids is None:
                positions = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape)
            else:
                positions = positions_from_segments(segment_ids)
        positions = jnp.asarray(positions, jnp.int32)
        # One cos/sin pair per RoPE kind in use (Gemma 3: local base for sliding layers, global for full).
        # M-RoPE (Qwen2-VL) reads positions [3, B, T] (t, h, w); the text of a row is `positions[0]`.
        tables = (functools.partial(mrope_tables, section=cfg.mrope_section) if cfg.mrope_section else rope_tables)
        rope = {kind: tables(positions, cfg.rope_for(kind), cfg.head_dim, cfg.max_position_embeddings,
                             self.dtype) for kind in dict.fromkeys(cfg.layer_ropes)}
        metadata = {window: None for window in cfg.layer_windows}
        # Only the Pallas kernels read block tables; "auto" runs them on GPUs alone (off the GPU it is the
        # reference, and building unused tables cost the CPU quickstart about half of its step time).
        if execution.attention == "pallas" or (execution.attention == "auto" and jax.default_backend() == "gpu"):
            # The block table depends only on the batch: one per distinct window, shared by every layer.
            seg = segment_ids if segment_ids is not None else jnp.ones(shape, jnp.int32)
            for window in metadata:
                metadata[window] = attention_ops.make_metadata(seg, causal=True, sliding_window=window)
        return dict(input_ids=input_ids, positions=positions, segment_ids=segment_ids, rope=rope,
                    metadata=metadata, attention=execution.attention)

    def _attend_fn(self, ctx, window):
        cfg = self.config
        return functools.partial(
            per_device_attention, segment_ids=ctx["segment_ids"], metadata=ctx["metadata"][window],
            causal=True, sliding_window=window, logit_softcap=cfg.attn_logit_softcap, scale=cfg.attn_scale,
            implementation=ctx["attention"])

    # ---------------------------------------------------------------- forward
    def hidden_states(self, input_ids=None, positions=None, segment_ids=None, *, dropout_rng=None,
                      execution: ExecutionConfig = DEFAULT_EXECUTION, inputs_embeds=None) -> jax.Array:
        """Final-normed hidden states [B, T, H] (what the LM head, or a fused loss, consumes). `execution` says
        how (attention kernel, remat policy); the numbers do not depend on it beyond float rounding.

        `inputs_embeds` [B, T, H] replaces the token embedding (e.g. a vision tower's output merged with
        text embeddings); as in transformers it is used as given (no embedding scale)."""
        return self._forward(input_ids, positions, segment_ids, dropout_rng, execution, inputs_embeds, False)[0]

    def hidden_states_and_router_stats(self, input_ids, positions=None, segment_ids=None, *, dropout_rng=None,
                                       execution: ExecutionConfig = DEFAULT_EXECUTION):
        """(final-normed hidden states, router stats [2, E] summed over the sparse layers, counted rows): what
        `jaxft.models.moe.load_balancing_loss` needs. Tokens count unless they are padding (segment id 0); rows
        = counted tokens x sparse layers (transformers' attention-mask handling)."""
        return self._forward(input_ids, positions, segment_ids, dropout_rng, execution, None, True)

    def _forward(self, input_ids, positions, segment_ids, dropout_rng, execution, inputs_embeds, with_stats):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Decoder.hidden_states: pass exactly one of input_ids and inputs_embeds")
        cfg = self.config
        if with_stats and not cfg.num_experts:
            raise ValueError(f"Decoder.hidden_states_and_router_stats: this {cfg.model_type} model has no router")
        shape = None if inputs_embeds is None else inputs_embeds.shape[:2]
        ctx = self.batch_context(input_ids, positions, segment_ids, execution, shape=shape)
        x = self.embed_tokens(ctx["input_ids"]) if inputs_embeds is None else jnp.asarray(inputs_embeds, self.dtype)
        extra, stats, rows = {}, None, None
        if with_stats:
            seg = ctx["segment_ids"]
            weights = jnp.ones(x.shape[:2], jnp.float32) if seg is None else (seg != 0).astype(jnp.float32)
            extra = dict(router_token_weights=weights)
            stats = jnp.zeros((2, cfg.num_experts), jnp.float32)
            rows = jnp.sum(weights) * sum(m in SPARSE_MLPS for m in cfg.layer_mlps)  # sparse layers only, as HF

        def group_ctx(group):
            cos, sin = ctx["rope"][group.rope]
            # Sparse layers also get the grouped matmul of their experts (every gmm of the layer, LoRA included).
            sparse = dict(extra, grouped_matmul_implementation=execution.grouped_matmul_implementation,
                          moe_dispatch=execution.moe_dispatch)
            return dict(cos=cos, sin=sin, attend=self._attend_fn(ctx, group.window),
                        mlp_chunk_size=execution.mlp_chunk_size, **(sparse if group.mlp in SPARSE_MLPS else {}))

        policy = execution.layer_policy(cfg, x.shape[0], x.shape[1], x.dtype.itemsize)
        per_layer = execution.layer_policies(cfg, x.shape[0], x.shape[1], x.dtype.itemsize)
        out = run_groups(self.layer_stacks(), x, layer_groups(cfg), group_ctx, dropout_rng=dropout_rng,
                         policy=policy, per_layer=per_layer, router_stats=stats)
        x, stats = out if with_stats else (out, None)
        return self.final_norm(x), stats, rows

    def layer_stacks(self) -> dict[str, DecoderLayer]:
        """{stack attribute: stacked layer module} for every layer stack (see `jaxft.models.stack.layer_stacks`)."""
        return {name: getattr(self, name) for name in layer_stacks(self.config)}

    def embed_tokens(self, input_ids) -> jax.Array:
        """Token embeddings [B, T, H] in the activation dtype (times sqrt(H) rounded to it, for Gemma)."""
        x = self.embedding_table()[input_ids].astype(self.dtype)
        if self.embed_scale:
            # transformers multiplies by the normalizer cast to the weight dtype (bf16-rounded in bf16 runs).
            x = x * jnp.asarray(self.config.hidden_size ** 0.5, self.dtype)
        return x

    def embedding_table(self) -> jax.Array:
        """The embedding table [V, H] as the forward reads it: trained rows (`TokenRows`) in place."""
        return with_token_rows(self.embed.embedding[...], self.embed)

    def head_weight(self) -> tuple[jax.Array, str]:
        """The LM head's weight as stored and its layout, for `linear_cross_entropy(..., weight_layout=)`:
        (lm_head kernel [H, V], "hv"), or with `tie_word_embeddings` (the embedding table [V, H], "vh"). The
        table is handed over untransposed: `embedding.T` fed to the loss's chunk loop was materialised as a
        transposed copy (1.7 GiB for Gemma 2) at the no-remat step's memory peak."""
        if self.lm_head is None:
            table = self.embedding_table()
            return (table.astype(self.dtype) if isinstance(self.embed.embedding, TrainableParam) else table), "vh"
        kernel = self.lm_head.frozen_kernel(self.dtype if self.lm_head.quant is not None else None)
        if isinstance(getattr(self.lm_head, "kernel", None), TrainableParam):  # fp32 master copy: run in model dtype
            kernel = kernel.astype(self.dtype)
        return with_token_rows(kernel, self.lm_head, vocab_axis=1), "hv"

    def __call__(self, input_ids=None, positions=None, segment_ids=None, *, dropout_rng=None,
                 execution: ExecutionConfig = DEFAULT_EXECUTION, inputs_embeds=None) -> jax.Array:
        return self.logits(self.hidden_states(input_ids, positions, segment_ids, dropout_rng=dropout_rng,
                                              execution=execution, inputs_embeds=inputs_embeds))

    def logits(self, x) -> jax.Array:
        """LM-head logits [..., V] of final-normed hidden states [..., H] (tied embedding or lm_head), soft-capped
        by `final_logit_softcap` (Gemma 2)."""
        if self.lm_head is None:
            z = jnp.einsum("...h,vh->...v", x, self.embedding_table().astype(x.dtype))
        elif getattr(self.lm_head, "token_rows", None) is not None:
            z = jnp.einsum("...h,hv->...v", x, self.head_weight()[0].astype(x.dtype))
        else:
            z = self.lm_head(x)
        return softcap(z, self.config.final_logit_softcap)


def per_device_attention(q, k, v, *, segment_ids, metadata, implementation, sinks=None, **static) -> jax.Array:
    """`kernels_pallas.attention.dot_product_attention`, on each device's own rows when traced under a mesh of
    several devices and the implementation may run the Pallas flash kernels ("pallas", or "auto" with block tables:
    on a GPU, where it takes them for packed rows); otherwise the op as it is.

    Why: attention is independent per row, but XLA cannot partition the flash kernels' custom call, so under a
    mesh it all-gathers q, k and v to the whole batch and every device computes every row's attention (8 GPUs under
    FSDP: 16 synchronous all-gathers of bf16 [8, 4096, 8, 512] into the kernels; tests/test_sharding.py sees the
    same on CPU devices). Here the op runs in
    `jax.shard_map` with the rows split over the batch axes (`jaxft.mesh_axes.BATCH_AXES`, as `constrain_rows`
    splits the layer inputs) and the heads over "tensor" where both head counts divide by it; the batch's block
    tables (`make_metadata`, per row) are split with the rows, their batch-wide flag `single_segment` whole. The
    sinks [H] enter with the heads; shard_map's transpose sums their gradient over the devices. cuDNN's attention
    partitions itself and the reference is plain XLA, so those run as they are."""
    mesh = jax.get_abstract_mesh()
    call = functools.partial(attention_ops.dot_product_attention, implementation=implementation, **static)
    # "auto" may take the flash kernels where the decoder built their block tables (GPUs), never elsewhere.
    flash = implementation == "pallas" or (implementation == "auto" and metadata is not None)
    axes = row_split(mesh, q.shape[0])
    if axes is None or not flash:
        return call(q, k, v, segment_ids=segment_ids, metadata=metadata, sinks=sinks)
    tensor = mesh.shape.get("tensor", 1)
    heads = "tensor" if tensor > 1 and q.shape[2] % tensor == 0 and k.shape[2] % tensor == 0 else None
    qkv, by_row = jax.P(axes, None, heads, None), jax.P(axes)
    meta_specs = None if metadata is None else jax.tree.map(lambda a: by_row if a.ndim else jax.P(), metadata)

    def local(q, k, v, segment_ids, metadata, sinks):
        return call(q, k, v, segment_ids=segment_ids, metadata=metadata, sinks=sinks)

    return jax.shard_map(local, mesh=mesh, out_specs=qkv, check_vma=False, in_specs=(
        qkv, qkv, qkv, None if segment_ids is None else by_row, meta_specs, None if sinks is None else jax.P(heads),
    ))(q, k, v, segment_ids, metadata, sinks)
