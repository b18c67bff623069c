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
    inverse = the inverse permutation of order       (sorted position of each flat slot)
    xs = x[token]                                    [N*k, H], rows grouped by expert
    g|u = gmm(xs, [Wg | Wu]); h = act(g) * u; ys = gmm(h, Wd)   (one grouped matmul for gate and up, one for down)
    y[n] = sum_j w[n, j] ys[inverse[n k + j]]        (the weighted combine: k gathers, summed)
Both MoE blocks move rows by gathers in the forward AND the backward (`gather_tokens`, `combine`: custom VJPs whose
transposes are gathers by the inverse index; autodiff of a gather is a scatter-add, which XLA runs with atomics on
[N*k, H] rows, although every index here is a permutation or a k-fold repeat), and sum over a token's k picks as
k gathers added elementwise (`_picks`: measured faster than either a scatter-add or a reduction over k).
`gmm` is `kernels_pallas.grouped_matmul`, every call of a layer (experts, expert LoRA, 4-bit experts) with the
implementation the step's `ExecutionConfig.grouped_matmul_implementation` names: the decoder puts it in the
sparse layers' context and the block receives it per call (`branch(..., gmm_implementation=)`); the module
stores no choice (the model holds parameters and math, the execution config how).

The router is a plain parameter, not a `Linear`: LoRA never targets it (neither does PEFT: transformers' router
is not an nn.Linear); the experts are [E, in, out] stacks, also not `Linear`s: `ExpertParam`s, or with
`load_in_4bit` `jaxft.models.quant_experts.Quant4bitExperts`, with `load_in_fp8` `Fp8Experts` (the grouped matmul
on weights dequantised inside the layer, `expert_matmul`).

Expert LoRA (`ExpertLora`, PEFT's `target_parameters` on the fused `experts.gate_up_proj` / `down_proj`):
per expert e a rank-r update of W_e, applied without forming any per-expert delta weight:
    y = gmm(xs, W) + gmm(gmm(xs, A), s * B)        A [E, in, r], B [E, r, out] (fp32 `LoraParam`), s = alpha/r
The experts' own grouped matmuls add both adapters' B side in their accumulator (`expert_matmul(..., lora= /
adapter=)`). The gate/up adapter's A side runs as one dense matmul over the N tokens, not the N*k sorted rows
(`ExpertLora.sorted_factors`); the down adapter's is grouped over the sorted rows h, which exist only in that order
(`ExpertLora.grouped_adapter`: one op with the experts' down matmul, whose d lhs kernel also adds d xa A^T).
`ExpertLora.delta` is the grouped definition both equal.
The gate/up adapter is one adapter of width 2I (PEFT adapts the fused [E, 2I, H] parameter), like the weight it
adapts (`gate_up_proj` [E, H, 2I], gate's columns first): its output's first I columns add to gate, the last I to
up, so A is shared by both. Gradients: dB_e = s (xs_e A_e)^T dy_e
and dA_e = xs_e^T (dy_e (s B_e)^T) come out of the grouped matmuls' own transposes (ragged dots); the frozen
W is only read (d xs = dy W_e^T), never differentiated.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxft.config import ModelConfig
from jaxft.models.activations import ACTIVATIONS
from jaxft.models.layers import (ExpertParam, LoraParam, LoraRank, LoraScale, StackRow, _init, logical,
                                 stack_axes)
from jaxft.mesh_axes import BATCH_AXES, row_axes
from jaxft.models.quant_experts import expert_matmul
from jaxft.residuals import MLP_GATE_UP, MOE_EXPERT_OUT
from kernels_pallas.grouped_matmul import grouped_matmul


def route(x: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool):
    """(logits [N, E] in x's dtype, weights [N, k] in x's dtype, experts [N, k] int32) for tokens x [N, H]."""
    logits = jnp.einsum("nh,he->ne", x, router.astype(x.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return logits, weights.astype(x.dtype), experts.astype(jnp.int32)


def router_stats(logits: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
    """[2, E] fp32: row 0 the weighted count of top-k assignments per expert, row 1 the weighted sum of router
    probabilities per expert, over tokens with weights [N] (1 = counted, 0 = padding)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    k = experts.shape[-1]
    counts = jnp.zeros(probs.shape[-1], jnp.float32).at[experts.reshape(-1)].add(jnp.repeat(weights, k))
    return jnp.stack([counts, jnp.sum(probs * weights[:, None], axis=0)])


def load_balancing_loss(stats: jax.Array, rows: jax.Array) -> jax.Array:
    """Switch-Transformer load balancing as transformers' `load_balancing_loss_func`:

        aux = E * sum_e f_e P_e,   f_e = (top-k assignments to e) / rows,   P_e = (sum of p_e) / rows

    with counts and probability sums taken over every sparse layer's counted tokens together (`stats`, the sum
    of the layers' `router_stats`) and rows = counted tokens x sparse layers. f sums to k, not 1 (as there)."""
    return stats.shape[-1] * jnp.sum((stats[0] / rows) * (stats[1] / rows))


class Routing(NamedTuple):
    """The sort of `dispatch`, for N tokens with k assignments each (flat slot s = n * k + j):
    order [N*k]: the flat slots grouped by expert (token order within an expert: the sort is stable);
    token [N*k]: the token each sorted row reads (order // k); inverse [N*k]: the sorted row of each flat slot
    (order[inverse[s]] = s); group_sizes [E] int32: rows per expert (static length E, empty experts 0)."""

    order: jax.Array
    token: jax.Array
    inverse: jax.Array
    group_sizes: jax.Array


def dispatch(experts: jax.Array, num_experts: int) -> Routing:
    """Sort the N*k assignments [N, k] by expert (stable argsort, bincount of static length): a `Routing`."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    # The inverse of a permutation: a scatter of N*k int32 (no duplicates), cheaper than a second sort.
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype), unique_indices=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return Routing(order, order // experts.shape[-1], inverse, group_sizes)


def _picks(x: jax.Array, inverse: jax.Array, k: int) -> list[jax.Array]:
    """[x[inverse[n k + j]] for n < N], j < k: the rows of x [N*k, ...] of each token's j-th pick, one gather per
    j. The sums over k below add these k gathers elementwise: gathering [N, k, H] and reducing its middle axis
    computes the same sum 4.9x slower at Qwen3-30B-A3B's shape (k = 8: the combine and gather_tokens' backward)."""
    inv = inverse.reshape(-1, k)
    return [x[inv[:, j]] for j in range(k)]


def _summed_picks(x: jax.Array, inverse: jax.Array, k: int, weights: jax.Array | None = None) -> jax.Array:
    """[N, ...] fp32: sum_j (weights[n, j]) x[inverse[n k + j]], the k `_picks` added elementwise."""
    picks = [p.astype(jnp.float32) for p in _picks(x, inverse, k)]
    if weights is not None:
        w = weights.astype(jnp.float32)
        picks = [p * w[:, j, None] for j, p in enumerate(picks)]
    return functools.reduce(jnp.add, picks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gather_tokens(xf: jax.Array, token: jax.Array, inverse: jax.Array, k: int) -> jax.Array:
    """xs = xf[token]: the [N*k, H] expert-sorted copy of the tokens xf [N, H], each token k times.

    Gradient: xs[s] = xf[order[s] // k], so d xf[n] = sum_j d xs[inverse[n k + j]] - k gathers of d xs (`_picks`)
    summed in fp32 (autodiff would scatter-add d xs into xf's rows, with atomics)."""
    return xf[token]


def _gather_tokens_fwd(xf, token, inverse, k):
    return xf[token], inverse


def _gather_tokens_bwd(k, inverse, g):
    return _summed_picks(g, inverse, k).astype(g.dtype), None, None


gather_tokens.defvjp(_gather_tokens_fwd, _gather_tokens_bwd)


@jax.custom_vjp
def unsort_rows(ys: jax.Array, inverse: jax.Array, order: jax.Array) -> jax.Array:
    """ys[inverse]: expert-sorted rows [N*k, ...] back in flat slot order (row n * k + j = token n's j-th pick).

    Gradient: the transpose of a permutation is its inverse, so d ys = g[order] (a gather, not a scatter)."""
    return ys[inverse]


def _unsort_rows_fwd(ys, inverse, order):
    return ys[inverse], order


def _unsort_rows_bwd(order, g):
    return g[order], None, None


unsort_rows.defvjp(_unsort_rows_fwd, _unsort_rows_bwd)


@jax.custom_vjp
def _weighted_sum(ys: jax.Array, weights: jax.Array, inverse: jax.Array, order: jax.Array) -> jax.Array:
    """[N, H] fp32: sum_j weights[n, j] ys[inverse[n k + j]] for expert-sorted rows ys [N*k, H] (`_picks`).

    Gradient, for g = d out [N, H] (fp32):
        d weights[n, j] = sum_h g[n, h] ys[inverse[n k + j], h]          (the same k gathers, each reduced over H)
        d ys[s] = weights[n, j] g[n]  for s = inverse[n k + j]:  (weights * g)[order]   (a gather, not a scatter)"""
    return _weighted_sum_fwd(ys, weights, inverse, order)[0]


def _weighted_sum_fwd(ys, weights, inverse, order):
    return _summed_picks(ys, inverse, weights.shape[-1], weights), (ys, weights, inverse, order)


def _weighted_sum_bwd(res, g):
    ys, weights, inverse, order = res
    n, k = weights.shape
    dw = jnp.stack([jnp.sum(g * p.astype(jnp.float32), axis=-1) for p in _picks(ys, inverse, k)], axis=-1)
    dys = (g[:, None, :] * weights.astype(jnp.float32)[..., None]).astype(ys.dtype).reshape(n * k, -1)[order]
    return dys, dw.astype(weights.dtype), None, None


_weighted_sum.defvjp(_weighted_sum_fwd, _weighted_sum_bwd)


def combine(ys: jax.Array, weights: jax.Array, routing: Routing, xf: jax.Array) -> jax.Array:
    """The weighted combine of `dispatch`: y[n] = sum_j weights[n, j] ys[inverse[n k + j]] for the expert-sorted
    outputs ys [N*k, H], into xf's shape [N, H] and dtype. Products and the sum over k are taken in fp32 and
    rounded once to the activations' dtype.
    Rows move by gathers both ways (`_weighted_sum`): the definition, a scatter-add of the weighted rows into the
    tokens with x[token] (whose autodiff is another scatter-add), is 2.5x slower at Qwen3-30B-A3B's shape."""
    return _weighted_sum(ys, weights, routing.inverse, routing.order).astype(xf.dtype)


class ExpertLora(nnx.Module):
    """LoRA on a stack of expert weights [L, E, in, out]: A [L, E, in, r_max], B [L, E, r_max, out] (fp32),
    per-layer scale [L] (0 where the layer is not targeted) and rank [L] (columns/rows past it are zero, as
    for `jaxft.models.layers.Linear`). Called on one layer's slice: `delta(xs, sizes)` = gmm(gmm(xs, A), s B),
    both grouped matmuls by `gmm_implementation`."""

    def __init__(self, a: jax.Array, b: jax.Array, scale: jax.Array, rank: jax.Array):
        self.lora_a = LoraParam(a)
        self.lora_b = LoraParam(b)
        self.lora_scale = LoraScale(scale)
        self.lora_rank = LoraRank(rank)

    def _scaled_b(self, dtype) -> jax.Array:
        # The scale is folded into the small [E, r, out] factor, never multiplied into a [tokens, out] tensor.
        return (self.lora_b[...] * self.lora_scale[...]).astype(dtype)

    def delta(self, xs: jax.Array, group_sizes: jax.Array, gmm_implementation: str = "auto") -> jax.Array:
        """gmm(gmm(xs, A), s B) on expert-sorted rows xs [R, in]: the definition the two forms below compute."""
        with jax.named_scope("expert_lora"):
            xa = grouped_matmul(xs, self.lora_a[...].astype(xs.dtype), group_sizes, implementation=gmm_implementation)
            return grouped_matmul(xa, self._scaled_b(xs.dtype), group_sizes, implementation=gmm_implementation)

    def sorted_factors(self, xf: jax.Array, experts: jax.Array, routing: Routing) -> tuple[jax.Array, jax.Array]:
        """(xa [N*k, r] in expert-sorted row order, s B [E, r, out]) in xf's dtype: the factors whose grouped
        product gmm(xa, s B) is delta(xf[routing.token], sizes), for the tokens xf [N, in] with their experts
        [N, k]. The experts' own grouped matmul takes them as its `lora` (`expert_matmul`), so the Mosaic kernels
        add gmm(xa, s B) in their accumulator instead of writing an [N*k, out] product and adding it after. The A
        side runs on the N tokens instead of the N*k sorted rows:

            Z = xf @ [A_0 | ... | A_{E-1}]   [N, E, r], one dense matmul (N x in x E r)
            xa[s] = Z[token(s), expert(s)]   a gather of r-wide rows (n, e[n, j]), put in sorted order

        Gradient: autodiff; d Z is the scatter of d xa's r-wide rows back to (n, e[n, j]) ([N, E, r], small), then
        d xf = d Z A^T and d A = xf^T d Z are dense matmuls. Why: the grouped form reads the [N*k, in] sorted rows
        three times (forward, d lhs, d rhs) for a rank-r product whose tiles are padded to 64 columns; the dense
        one reads the N tokens, k times fewer rows, at E r columns (GPT-OSS-20B: 512)."""
        with jax.named_scope("expert_lora"):
            n, k = experts.shape
            z = jnp.einsum("nh,ehr->ner", xf, self.lora_a[...].astype(xf.dtype))
            picked = jnp.take_along_axis(z, experts[..., None], axis=1).reshape(n * k, z.shape[-1])
            xa = unsort_rows(picked, routing.order, routing.inverse)  # flat slots -> sorted rows: picked[order]
            return xa, self._scaled_b(xf.dtype)

    def grouped_adapter(self, dtype) -> tuple[jax.Array, jax.Array]:
        """(A [E, in, r], s B [E, r, out]) in `dtype`: the down adapter, whose grouped product gmm(gmm(h, A), s B)
        on the expert-sorted rows h the experts' down matmul adds (`expert_matmul(..., adapter=)`; on the Mosaic
        kernels the B side in its forward's accumulator and d xa A^T in its d lhs kernel's). The A side is grouped:
        the rows h exist only in sorted order (the experts' hidden activations), so there is no token-side form.
        Gradient: the grouped products' rules (d xa = d y (s B)^T, d h = d y W^T + d xa A^T, d A = h^T d xa,
        d B = s xa^T d y, per group)."""
        return self.lora_a[...].astype(dtype), self._scaled_b(dtype)


def expert_adapters(module: nnx.Module):
    """(dotted path, ExpertLora) for every expert adapter under `module`, in a stable order."""
    out = [(".".join(str(p) for p in path), node) for path, node in nnx.iter_graph(module)
           if isinstance(node, ExpertLora)]
    return sorted(out, key=lambda item: item[0])


def per_device(block: nnx.Module, x: jax.Array, token_weights: jax.Array | None, gmm_implementation: str,
               dispatch: str = "auto"):
    """`block(x, token_weights, gmm_implementation=)`, on each device's own rows under a mesh of several devices
    unless `dispatch` (`ExecutionConfig.moe_dispatch`) is "global"; any single-device trace calls the block as it is.

    Why: as one program over the batch, the block's routing is global. XLA all-gathers the expert ids to sort
    them, and every device then runs the experts' grouped matmuls on every token of the batch. On 8 host devices
    (data 2 x fsdp 4, tiny Qwen3-MoE, lax.ragged_dot) the compiled step sorted 1024 slots and multiplied
    [1024, ...] rows on each device, against 128 here. The Mosaic GPU kernels' custom call is not partitioned at
    all. Here the block runs in `jax.shard_map` over the batch axes (`jaxft.mesh_axes.BATCH_AXES`, the rows
    `constrain_rows` already splits), and over any other mesh axis (tensor) along the tokens of a row: each device
    sorts, multiplies and combines its own tokens.

    The weights enter whole (P()): XLA gathers fsdp/tensor-split expert stacks, one layer's at a time, as it does
    for a matmul, and a layer scan's `StackRow` enters as the layer's row. The router statistics are summed over
    the devices that split the tokens. Gradients of the replicated weights (the expert adapters) are summed over
    the devices by shard_map's transpose. (Expert parallelism, experts split over devices with an all-to-all, is
    not built.)"""
    mesh = jax.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or dispatch == "global":
        return block(x, token_weights, gmm_implementation=gmm_implementation)
    axes = row_axes(mesh)
    # The tensor axis holds copies of the rows (activations are whole across it): its devices split the tokens
    # of a row instead, when they divide evenly, so no two devices run the same token's experts.
    tensor = [a for a in mesh.axis_names if a not in BATCH_AXES and mesh.shape[a] > 1
              and x.ndim == 3 and x.shape[1] % mesh.shape[a] == 0]
    rows = jax.P(axes or None, tuple(tensor) or None)
    summed = (*axes, *tensor)
    graphdef, state = nnx.split(block)
    state = nnx.from_flat_state([(p, v.replace(v.get_value().sliced()) if isinstance(v.get_value(), StackRow) else v)
                                 for p, v in nnx.to_flat_state(state)])

    def local(state, x, token_weights):
        out = nnx.merge(graphdef, state)(x, token_weights, gmm_implementation=gmm_implementation)
        if token_weights is None:
            return out
        y, stats = out
        return y, (jax.lax.psum(stats, summed) if summed else stats)

    specs = rows if token_weights is None else (rows, jax.P())
    return jax.shard_map(local, mesh=mesh, in_specs=(jax.P(), rows, None if token_weights is None else rows),
                         out_specs=specs, check_vma=False)(state, x, token_weights)


class GroupedExperts(nnx.Module):
    """What both MoE MLPs run: a router, E experts held as two stacked weights (gate/up fused [E, H, 2I], down
    [E, I, H], [in, out] like `Linear.kernel`) with an expert adapter slot each, and the sort-based step: route,
    `dispatch`, `gather_tokens`, ONE grouped matmul per projection, `combine`. A subclass says how it routes
    (`route_rows`), what the fused gate/up becomes (`activate`) and whether its experts add biases
    (`EXPERT_BIASES`: gate_up_bias [E, 2I] and down_bias [E, H], gathered per sorted row); the MLP slot's `branch` /
    `infer` interface."""

    NUM_LINEARS = 0  # no LoRA'd linears inside, so no dropout keys
    # Expert adapter slot -> the expert weight it adapts (as PEFT's target_parameters: one 3-D parameter each).
    LORA_KERNELS = {"gate_up_lora": "gate_up_proj", "down_lora": "down_proj"}
    EXPERT_BIASES = False

    def _experts(self, cfg: ModelConfig, stack, dtype, rngs) -> tuple:
        """The router [H, E] and the two expert weights; the stack's logical axes (for a subclass's own params)."""
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        lead = stack_axes(stack)
        self.router = nnx.Param(_init(rngs, (*stack, h, e), dtype, 0.02), **logical(*lead, "embed", "experts"))
        self.gate_up_proj = ExpertParam(_init(rngs, (*stack, e, h, 2 * i), dtype, 0.02),
                                      **logical(*lead, "experts", "embed", "mlp"))
        self.down_proj = ExpertParam(_init(rngs, (*stack, e, i, h), dtype, 0.02),
                                   **logical(*lead, "experts", "mlp", "embed"))
        self.num_experts, self.top_k = e, cfg.num_experts_per_tok
        self.gate_up_lora: ExpertLora | None = None  # set by jaxft.lora
        self.down_lora: ExpertLora | None = None
        return lead

    def route_rows(self, xf: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(logits [N, E], weights [N, k], experts [N, k] int32) of the tokens xf [N, H]."""
        raise NotImplementedError

    def activate(self, gate_up: jax.Array) -> jax.Array:
        """The fused gate/up output of the sorted rows [rows, 2I] -> the down projection's input [rows, I]."""
        raise NotImplementedError

    def __call__(self, x: jax.Array, token_weights: jax.Array | None = None, *, gmm_implementation: str = "auto"):
        """The block's output; with `token_weights` ([B, T] fp32, 0 on padding) also its `router_stats`. Every
        grouped matmul runs by `gmm_implementation` (`ExecutionConfig.grouped_matmul_implementation`)."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        with jax.named_scope("moe_router"):
            logits, weights, experts = self.route_rows(xf)
            routing = dispatch(experts, self.num_experts)
            sizes = routing.group_sizes
            # The expert of each sorted row, for its biases.
            expert_of_row = experts.reshape(-1)[routing.order] if self.EXPERT_BIASES else None
            stats = None if token_weights is None else router_stats(logits, experts, token_weights.reshape(-1))

        def bias(y, name):
            return y if expert_of_row is None else y + getattr(self, name)[...].astype(x.dtype)[expert_of_row]

        with jax.named_scope("moe_experts"):
            xs = gather_tokens(xf, routing.token, routing.inverse, self.top_k)
            gmm = gmm_implementation
            lora = None if self.gate_up_lora is None else self.gate_up_lora.sorted_factors(xf, experts, routing)
            gate_up = bias(expert_matmul(xs, self.gate_up_proj, sizes, gmm, lora=lora), "gate_up_bias")
            # Named as the dense MLP's gate/up: a remat policy that keeps or offloads it skips the largest
            # recompute of the layer (this grouped matmul) in the backward.
            h = self.activate(checkpoint_name(gate_up, MLP_GATE_UP))
            adapter = None if self.down_lora is None else self.down_lora.grouped_adapter(h.dtype)
            ys = bias(expert_matmul(h, self.down_proj, sizes, gmm, adapter=adapter), "down_bias")
            ys = checkpoint_name(ys, MOE_EXPERT_OUT)  # what the combine's backward reads (jaxft.memory.policy)
            out = combine(ys, weights, routing, xf).reshape(shape)
        return out if stats is None else (out, stats)

    def branch(self, norm, h, rngs: tuple, prevent_cse: bool, token_weights: jax.Array | None = None, *,
               gmm_implementation: str = "auto", dispatch: str = "auto"):
        # Nothing LoRA'd inside: autodiff keeps what the grouped matmuls' backward needs.
        return per_device(self, norm(h), token_weights, gmm_implementation, dispatch)

    def infer(self, x) -> jax.Array:
        return self(x)


class MoeMLP(GroupedExperts):
    """Qwen3-MoE's router (softmax over all E, top-k, optionally renormalised) + E gated experts (see the module
    docstring). The fused gate/up holds gate's I columns, then up's: one grouped matmul of width 2I reads the sorted
    rows once, on the wider tiles the kernels run faster."""

    def __init__(self, cfg: ModelConfig, *, stack, dtype, rngs):
        self._experts(cfg, stack, dtype, rngs)
        self.norm_topk_prob = cfg.norm_topk_prob
        self.hidden_act = cfg.hidden_act  # a name (static), looked up in ACTIVATIONS

    def route_rows(self, xf):
        return route(xf, self.router[...], self.top_k, self.norm_topk_prob)

    def activate(self, gate_up):
        gate, up = jnp.split(gate_up, 2, axis=-1)  # gate's columns first (the bridge's `Row.part`)
        return ACTIVATIONS[self.hidden_act](gate, up)
