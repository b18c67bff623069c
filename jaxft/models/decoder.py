"""One decoder for Llama / Mistral / Qwen2 / Qwen3 dense models.

Data flow of a forward pass:
    batch-level, computed ONCE:  positions (derived from segment_ids when absent), cos/sin tables,
                                 attention block metadata
    embed -> scan over stacked layers [norm -> q,k,v (+LoRA) -> (q/k norm) -> RoPE -> attention -> o
                                       -> residual -> norm -> GLU MLP (+LoRA) -> residual]
          -> final norm -> lm_head (or tied embedding)
Layers whose sliding window differs (Qwen2 `max_window_layers`) are scanned as contiguous runs.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxft.config import ModelConfig
from jaxft.execution import ExecutionConfig
from jaxft.models.layers import DecoderLayer, Linear, RMSNorm, _init
from jaxft.models.rope import rope_tables
from kernels_pallas import attention as attention_ops

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


def _layer_runs(windows: tuple[int | None, ...]) -> list[tuple[int, int, int | None]]:
    runs, start = [], 0
    for window, group in itertools.groupby(windows):
        n = len(list(group))
        runs.append((start, start + n, window))
        start += n
    return runs


def is_unstacked(layer_state: nnx.State) -> bool:
    """True when the per-layer parameters are tuples of per-layer arrays (see jaxft.train.unstack_layers)."""
    return any(isinstance(v.get_value(), tuple) for _, v in nnx.to_flat_state(layer_state))


def layer_slice(layer_state: nnx.State, i: int) -> nnx.State:
    """Layer i's parameters: element i of a per-layer tuple, or a static slice of a stacked array."""
    return nnx.from_flat_state([(p, v.replace(v.get_value()[i])) for p, v in nnx.to_flat_state(layer_state)])


class Decoder(nnx.Module):
    """A causal LM. `model(input_ids, positions=None, segment_ids=None) -> logits [B, T, V]`."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.embed = nnx.Module()
        self.embed.embedding = nnx.Param(_init(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, 0.02))
        self.layers = DecoderLayer(cfg, stack=(cfg.num_layers,), dtype=dtype, rngs=rngs)
        self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, stack=(), dtype=dtype)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        Linear(cfg.hidden_size, cfg.vocab_size, bias=False, stack=(), dtype=dtype, rngs=rngs))

    # ---------------------------------------------------------------- batch-level metadata (once per step)
    def batch_context(self, input_ids, positions=None, segment_ids=None,
                      execution: ExecutionConfig = DEFAULT_EXECUTION) -> dict[str, Any]:
        """Everything every layer needs that depends only on the batch: built once, outside the layer scan."""
        with jax.named_scope("batch_context"):
            return self._batch_context(input_ids, positions, segment_ids, execution)

    def _batch_context(self, input_ids, positions, segment_ids, execution) -> dict[str, Any]:
        cfg = self.config
        input_ids = jnp.asarray(input_ids, jnp.int32)
        if segment_ids is not None:
            segment_ids = jnp.asarray(segment_ids, jnp.int32)
        if positions is None:
            if segment_ids is None:
                positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
            else:
                positions = positions_from_segments(segment_ids)
        positions = jnp.asarray(positions, jnp.int32)
        cos, sin = rope_tables(positions, cfg.rope, cfg.head_dim, cfg.max_position_embeddings, self.dtype)
        metadata = {window: None for window in cfg.layer_windows}
        if execution.attention in ("pallas", "auto"):
            # The block table depends only on the batch: one per distinct window, shared by every layer.
            seg = segment_ids if segment_ids is not None else jnp.ones(input_ids.shape, jnp.int32)
            for window in metadata:
                metadata[window] = attention_ops.make_metadata(seg, causal=True, sliding_window=window)
        return dict(input_ids=input_ids, positions=positions, segment_ids=segment_ids, cos=cos, sin=sin,
                    metadata=metadata, attention=execution.attention)

    def _attend_fn(self, ctx, window):
        return functools.partial(
            attention_ops.dot_product_attention, segment_ids=ctx["segment_ids"], metadata=ctx["metadata"][window],
            causal=True, sliding_window=window, implementation=ctx["attention"])

    # ---------------------------------------------------------------- forward
    def hidden_states(self, input_ids, positions=None, segment_ids=None, *, dropout_rng=None,
                      execution: ExecutionConfig = DEFAULT_EXECUTION) -> jax.Array:
        """Final-normed hidden states [B, T, H] (what the LM head, or a fused loss, consumes). `execution` says
        how (attention kernel, remat policy); the numbers do not depend on it beyond float rounding."""
        ctx = self.batch_context(input_ids, positions, segment_ids, execution)
        x = self.embed_tokens(ctx["input_ids"])
        graphdef, state = nnx.split(self.layers)
        unrolled = is_unstacked(state)
        for start, end, window in _layer_runs(self.config.layer_windows):
            # Unrolled layers run as separate program regions, so XLA could merge a recomputation back into
            # the forward pass; the CSE barriers keep remat meaning remat there (inside a scan they are moot).
            layer_ctx = dict(cos=ctx["cos"], sin=ctx["sin"], attend=self._attend_fn(ctx, window),
                             prevent_cse=unrolled)
            layer_fn = self._layer_fn(graphdef, layer_ctx, dropout_rng, remat=execution.remat, prevent_cse=unrolled)
            if unrolled:
                for i in range(start, end):
                    x = layer_fn(x, layer_slice(state, i), i)
                continue
            run_state = state if (start, end) == (0, self.config.num_layers) else jax.tree.map(
                lambda leaf: leaf[start:end], state)
            indices = jnp.arange(start, end, dtype=jnp.int32)
            x, _ = jax.lax.scan(lambda carry, xs: (layer_fn(carry, *xs), None), x, (run_state, indices))
        return self.final_norm(x)

    @staticmethod
    def _layer_fn(graphdef, layer_ctx, dropout_rng, *, remat: str, prevent_cse: bool):
        """`(x, layer_state, index) -> x` for one layer, rematerialised per the `remat` policy."""
        def layer_fn(carry, layer_state, index):
            layer = nnx.merge(graphdef, layer_state)
            if remat == "offload":
                carry = checkpoint_name(carry, "layer_input")
            rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, index)
            return layer(carry, layer_ctx, rng)

        if remat == "none":
            return layer_fn
        policy = {
            "full": jax.checkpoint_policies.nothing_saveable,
            "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
                names_which_can_be_saved=[], names_which_can_be_offloaded=["layer_input"],
                offload_src="device", offload_dst="pinned_host"),
        }[remat]
        return jax.checkpoint(layer_fn, policy=policy, prevent_cse=prevent_cse)

    def embed_tokens(self, input_ids) -> jax.Array:
        """Token embeddings [B, T, H] in the activation dtype."""
        return self.embed.embedding[...][input_ids].astype(self.dtype)

    def head_weight(self) -> jax.Array:
        """The LM head as [H, V] (the tied embedding transposed when `tie_word_embeddings`)."""
        if self.lm_head is None:
            return self.embed.embedding[...].T
        return self.lm_head.kernel[...]

    def __call__(self, input_ids, positions=None, segment_ids=None, *, dropout_rng=None,
                 execution: ExecutionConfig = DEFAULT_EXECUTION) -> jax.Array:
        return self.logits(self.hidden_states(input_ids, positions, segment_ids, dropout_rng=dropout_rng,
                                              execution=execution))

    def logits(self, x) -> jax.Array:
        """LM-head logits [..., V] of final-normed hidden states [..., H] (tied embedding or lm_head)."""
        if self.lm_head is None:
            return jnp.einsum("...h,vh->...v", x, self.embed.embedding[...].astype(x.dtype))
        return self.lm_head(x)


def init_model(cfg: ModelConfig, *, dtype=jnp.bfloat16, seed: int = 0, **kw) -> Decoder:
    """A randomly initialised model (normal(0, 0.02) linears and embeddings, unit norms)."""
    return Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(seed), **kw)


def abstract_model(cfg: ModelConfig, *, dtype=jnp.bfloat16, **kw) -> Decoder:
    """The model with `jax.ShapeDtypeStruct` leaves: no memory is allocated (for real-size shape checks)."""
    return nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0), **kw))
