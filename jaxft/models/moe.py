"""The mixture-of-experts MLP (Qwen3-MoE's sparse block) for the MLP slot, with sort-based routing.

Math, for the tokens x [N, H] of one layer (N = B * T), E experts of width I, top-k routing:
    router:   z = x Wr  ([N, E], in x's dtype),  p = softmax(fp32(z))  over ALL experts
    top-k:    (w, e) = top_k(p, k)   [N, k];  w /= sum_k w  when norm_topk_prob;  w cast to x's dtype
    expert j: f_j(x) = down_j(act(gate_j(x)) * up_j(x))
    y[n] = sum_k w[n, k] * f_{e[n, k]}(x[n])
(transformers' Qwen3MoeSparseMoeBlock; its experts loop over the experts that received tokens, one host
sync per layer to find them.)

Dispatch here has neither a host sync nor a loop over experts, and every shape is static:
    flatten the N*k assignments, argsort them (stable) by expert id -> `order`; token of slot s = order[s] // k
    group sizes = bincount(expert ids, length=E)     (static length: empty experts are size-0 groups)
    xs = x[token]                                    [N*k, H], rows grouped by expert
    h  = act(gmm(xs, Wg)) * gmm(xs, Wu); ys = gmm(h, Wd) * w[order]  (one grouped matmul per projection)
    y  = zeros[N, H].at[token].add(ys)               (the weighted scatter back; duplicates are summed)
`gmm` is `kernels_pallas.grouped_matmul`. The router is a plain parameter, not a `Linear`: LoRA never
targets it (neither does PEFT: transformers' router is not an nn.Linear); the experts are [E, in, out]
stacks, also not `Linear`s (expert LoRA is not supported yet).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxft.config import ModelConfig
from jaxft.models.layers import _init, logical, stack_axes
from kernels_pallas.grouped_matmul import grouped_matmul


def route(x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool):
    """(logits [N, E] in x's dtype, weights [N, k] in x's dtype, experts [N, k] int32) for tokens x [N, H]."""
    logits = jnp.einsum("nh,he->ne", x, router.astype(x.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return logits, weights.astype(x.dtype), experts.astype(jnp.int32)


def dispatch(experts: jax.Array, num_experts: int):
    """Sort the N*k assignments by expert: (order [N*k], token [N*k], group_sizes [E] int32).

    `order` lists flat assignment slots (n * k + j) grouped by expert, in token order within an expert (the
    sort is stable); `token` is the token each sorted slot reads and writes back to."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // experts.shape[-1]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, token, group_sizes


class MoeMLP(nnx.Module):
    """Router + E gated experts (see the module docstring); the MLP slot's `branch` / `infer` interface."""

    NUM_LINEARS = 0  # no LoRA'd linears inside, so no dropout keys

    def __init__(self, cfg: ModelConfig, *, stack, dtype, rngs):
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        # Our layouts are [in, out] like `Linear.kernel`: router [H, E], experts [E, H, I] and [E, I, H].
        lead = stack_axes(stack)
        self.router = nnx.Param(_init(rngs, (*stack, h, e), dtype, 0.02), **logical(*lead, "embed", "experts"))
        self.gate_proj = nnx.Param(_init(rngs, (*stack, e, h, i), dtype, 0.02),
                                   **logical(*lead, "experts", "embed", "mlp"))
        self.up_proj = nnx.Param(_init(rngs, (*stack, e, h, i), dtype, 0.02),
                                 **logical(*lead, "experts", "embed", "mlp"))
        self.down_proj = nnx.Param(_init(rngs, (*stack, e, i, h), dtype, 0.02),
                                   **logical(*lead, "experts", "mlp", "embed"))
        self.num_experts, self.top_k, self.norm_topk_prob = e, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.hidden_act = cfg.hidden_act  # a name (static), looked up in parts.ACTIVATIONS

    def __call__(self, x: jax.Array) -> jax.Array:
        from jaxft.models.parts import ACTIVATIONS  # parts registers this class in its MLP slot

        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        with jax.named_scope("moe_router"):
            _, weights, experts = route(xf, self.router[...], self.top_k, self.norm_topk_prob)
            order, token, sizes = dispatch(experts, self.num_experts)
        with jax.named_scope("moe_experts"):
            xs = xf[token]
            gate = grouped_matmul(xs, self.gate_proj[...].astype(x.dtype), sizes)
            up = grouped_matmul(xs, self.up_proj[...].astype(x.dtype), sizes)
            h = ACTIVATIONS[self.hidden_act](gate, up)
            ys = grouped_matmul(h, self.down_proj[...].astype(x.dtype), sizes)
            ys = ys * weights.reshape(-1)[order][:, None]
            out = jnp.zeros_like(xf).at[token].add(ys)
        return out.reshape(shape)

    def branch(self, norm, h, rngs: tuple, prevent_cse: bool) -> jax.Array:
        # Nothing LoRA'd inside: autodiff keeps what the grouped matmuls' backward needs.
        return self(norm(h))

    def infer(self, x) -> jax.Array:
        return self(x)
