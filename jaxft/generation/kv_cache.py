"""The decoder's forward pass over new tokens with a key/value cache.

Cache layout: `{"k": K, "v": V}` with K, V of shape [layers, batch, max_len, kv_heads, head_dim] in the model
dtype when the layer weights are stacked, or tuples of per-layer [batch, max_len, kv_heads, head_dim] arrays
when they are unstacked (`jaxft.train.unstack_layers`): the cache follows the weights, so stacked layers are
scanned (compile time independent of depth) and unstacked ones unrolled, as in `Decoder.hidden_states`.

Slot u of a row holds the rotated k/v of that row's token at position u. Prompts are right-padded, so a
row's positions are 0, 1, ... exactly as if it ran alone, and every row writes its new token at its own
position. Attention of a query at position p reads slots u with p - window < u <= p: pad tokens of the
prefill sit in slots at or beyond the row's length, and each of those is overwritten by the decoded token
of that position before any query can see it, so no separate validity mask is needed.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxft.models.decoder import Decoder, is_unstacked, layer_slice
from jaxft.models.stack import layer_stacks, layout, mixed_rows, run_rows
from jaxft.models.rope import mrope_tables, rope_tables
from kernels_pallas.attention.reference import MASK_VALUE

# Window of a full-attention layer inside the layer scan (windows are scanned over as data there).
NO_WINDOW = 2**30


def init_cache(model: Decoder, batch: int, max_len: int) -> dict:
    """A zero cache for `batch` rows of `max_len` slots, stacked or per layer like the model's weights."""
    cfg = model.config
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    if is_unstacked(nnx.state(model.layers)):
        return {name: tuple(jnp.zeros(shape, model.dtype) for _ in range(cfg.num_layers)) for name in "kv"}
    return {name: jnp.zeros((cfg.num_layers, *shape), model.dtype) for name in "kv"}


def cached_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array,
                     window, *, scale: float | None = None, logit_softcap: float | None = None,
                     sinks: jax.Array | None = None) -> jax.Array:
    """q [B,T,H,D] at `positions` [B,T] over cache slots [B,S,KV,D]: causal, left window, fp32 softmax.

    The math of `kernels_pallas.attention.reference.attention_reference` (scores `scale * q.k`, scale
    defaulting to D^-1/2, soft-capped as c * tanh(s / c) before the mask, GQA by grouping the query heads,
    softmax and P@V in fp32, `sinks` [H] as one extra logit column whose probability is dropped), with the
    mask built from each query's absolute position instead of segment ids. `window` may be traced (one value
    per scanned layer).
    """
    b, t, h, d = q.shape
    s, kvh = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(d ** -0.5 if scale is None else scale)
    if logit_softcap is not None:
        scores = jnp.tanh(scores / logit_softcap) * logit_softcap
    diff = positions[:, :, None] - jnp.arange(s, dtype=jnp.int32)[None, None, :]  # [B, T, S]
    keep = (diff >= 0) & (diff < window)
    scores = jnp.where(keep[:, None, None], scores, MASK_VALUE)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kvh, h // kvh, 1, 1), (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache.astype(jnp.float32),
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


def _layer_attention(cfg, positions, rows, index, window):
    """`attend_cached` for one layer: `index` selects the layer of a stacked cache (None: a per-layer one)."""
    def attend_cached(q, k, v, cache, sinks=None):
        k_buf, v_buf = cache
        if index is None:
            k_buf = k_buf.at[rows, positions].set(k.astype(k_buf.dtype))
            v_buf = v_buf.at[rows, positions].set(v.astype(v_buf.dtype))
            k_layer, v_layer = k_buf, v_buf
        else:
            # Only the new tokens' slots are written; the loop carries the whole stacked cache in place.
            k_buf = k_buf.at[index, rows, positions].set(k.astype(k_buf.dtype))
            v_buf = v_buf.at[index, rows, positions].set(v.astype(v_buf.dtype))
            k_layer, v_layer = k_buf[index], v_buf[index]
        o = cached_attention(q, k_layer, v_layer, positions, window, scale=cfg.attn_scale,
                             logit_softcap=cfg.attn_logit_softcap, sinks=sinks)
        return o, (k_buf, v_buf)

    return attend_cached


def forward(model: Decoder, input_ids: jax.Array | None, positions: jax.Array, cache: dict,
            rope_positions: jax.Array | None = None, inputs_embeds: jax.Array | None = None
            ) -> tuple[jax.Array, dict]:
    """Final-normed hidden states [B,T,H] of tokens `input_ids` [B,T] (or of `inputs_embeds` [B,T,H]: a vision
    model's merged image embeddings) in cache slots `positions` [B,T], and the cache with their k/v written there.

    `rope_positions` (default `positions`) feed the RoPE tables only: the prefill passes 0 for pad tokens so
    that dynamic RoPE, which rescales theta from the largest position in the call (as transformers does),
    sees only real tokens; an M-RoPE model (Qwen2-VL) gets its 3-D (t, h, w) positions [3,B,T] here, which
    differ from the slots once a prompt holds an image.
    """
    cfg = model.config
    positions = jnp.asarray(positions, jnp.int32)
    rope_positions = positions if rope_positions is None else jnp.asarray(rope_positions, jnp.int32)
    # One cos/sin pair per RoPE kind (Gemma 3: local and global), stacked so a scanned layer picks its own.
    kinds = list(dict.fromkeys(cfg.layer_ropes))
    table = functools.partial(mrope_tables, section=cfg.mrope_section) if cfg.mrope_section else rope_tables
    tables = [table(rope_positions, cfg.rope_for(kind), cfg.head_dim, cfg.max_position_embeddings, model.dtype)
              for kind in kinds]
    cos_all, sin_all = jnp.stack([c for c, _ in tables]), jnp.stack([s for _, s in tables])
    rows = jnp.arange(positions.shape[0], dtype=jnp.int32)[:, None]
    if inputs_embeds is None:
        x = model.embed_tokens(jnp.asarray(input_ids, jnp.int32))
    else:
        x = jnp.asarray(inputs_embeds, model.dtype)
    # Layer i's parameters are row r of its stack (`jaxft.models.stack.layer_stacks`: one stack unless dense and
    # sparse layers are mixed); the cache is indexed by the layer itself.
    split = {name: nnx.split(module) for name, module in model.layer_stacks().items()}
    where = {i: (name, r) for name, layers in layer_stacks(cfg).items() for r, i in enumerate(layers)}
    # Linears 4-bit in some layers only (`jaxft.models.stack.mixed_rows`): each layer reads its own format's row.
    mixed = {name: mixed_rows(module) for name, module in model.layer_stacks().items()}

    def layer_ctx(index, window, rope):
        return dict(cos=cos_all[rope], sin=sin_all[rope],
                    attend_cached=_layer_attention(cfg, positions, rows, index, window))

    ropes = [kinds.index(kind) for kind in cfg.layer_ropes]
    if any(is_unstacked(state) for _, state in split.values()):
        k_all, v_all = list(cache["k"]), list(cache["v"])
        for i, window in enumerate(cfg.layer_windows):
            name, r = where[i]
            graphdef, state = split[name]
            layer = nnx.merge(graphdef, layer_slice(state, r, mixed[name]))
            x, (k_all[i], v_all[i]) = layer.cached(x, layer_ctx(None, window or NO_WINDOW, ropes[i]),
                                                   (k_all[i], v_all[i]))
        return model.final_norm(x), {"k": tuple(k_all), "v": tuple(v_all)}

    windows = jnp.asarray([w or NO_WINDOW for w in cfg.layer_windows], jnp.int32)
    ropes = jnp.asarray(ropes, jnp.int32)
    carry = (x, cache["k"], cache["v"])
    start = 0
    # One scan per run of consecutive layers in the same stack and layout (windows and RoPE kinds are scanned as
    # data).
    def run_key(i):
        name, r = where[i]
        return name, layout(mixed[name], r)

    for (name, _), run in itertools.groupby(range(cfg.num_layers), key=run_key):
        n = len(list(run))
        graphdef, state = split[name]
        first = where[start][1]
        if mixed[name]:
            state = run_rows(state, first, n, mixed[name])
        elif (first, n) != (0, _rows(state)):
            state = jax.tree.map(lambda leaf: leaf[first:first + n], state)

        def body(carry, xs, graphdef=graphdef):
            x, k_all, v_all = carry
            layer_state, index, window, rope = xs
            x, (k_all, v_all) = nnx.merge(graphdef, layer_state).cached(x, layer_ctx(index, window, rope),
                                                                        (k_all, v_all))
            return (x, k_all, v_all), None

        end = start + n
        xs = (state, jnp.arange(start, end, dtype=jnp.int32), windows[start:end], ropes[start:end])
        carry, _ = jax.lax.scan(body, carry, xs)
        start = end
    x, k_all, v_all = carry
    return model.final_norm(x), {"k": k_all, "v": v_all}


def _rows(state) -> int:
    """The number of rows of a stacked layer state."""
    return jax.tree.leaves(state)[0].shape[0]
