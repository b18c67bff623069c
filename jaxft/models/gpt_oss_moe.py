"""GPT-OSS's mixture-of-experts MLP for the MLP slot ("gpt_oss_moe"), on the sort-based routing of
`jaxft.models.moe`.

Math, for the tokens x [N, H] of one layer, E experts of width I, top-k routing (transformers'
GptOssTopKRouter / GptOssExperts):
    router:  z = x Wr + br                 [N, E], in x's dtype (a linear layer with a bias)
    top-k:   (v, e) = top_k(z, k);  w = softmax(v) over the k chosen logits only (not over all E)
    expert j, with its fused, INTERLEAVED gate/up weight Wgu_j [H, 2I] (even columns gate, odd columns up):
        gu = x Wgu_j + bgu_j;   g = min(gu[:, 0::2], L);   u = clip(gu[:, 1::2], -L, L)
        f_j(x) = ((u + 1) * g * sigmoid(alpha * g)) Wd_j + bd_j        (alpha 1.702, L = 7 by default)
    y[n] = sum_k w[n, k] * f_{e[n, k]}(x[n])

Dispatch is `jaxft.models.moe.dispatch` (stable argsort by expert, static bincount; no host sync, no loop
over experts; rows move by gathers both ways: `gather_tokens`, `combine`), then ONE grouped matmul for the
fused gate/up projection and one for down; the expert biases
are gathered per sorted row (bias[expert of the row]). The weights stay in transformers' layout ([E, in, out],
gate/up interleaved), so the bridge maps them without a transform and PEFT's `target_parameters` delta on
`experts.gate_up_proj` adds to the fused output column for column (no permutation anywhere).

Gradients: the activation is `kernels_pallas.glu.clamped_swiglu`, whose custom VJP keeps only the gate/up product
(autodiff kept several [rows, I] intermediates a layer) and whose clamps pass the gradient strictly inside their
bounds, as torch's clamp, and none on or outside them; the grouped matmuls differentiate by their implementation's
rules (`kernels_pallas.grouped_matmul`: ragged dots for "xla", the Mosaic kernels' custom VJP), chosen per step by
`ExecutionConfig.grouped_matmul_implementation` (`jaxft.models.moe`).
The two expert weights are `ExpertParam`s, 4-bit `Quant4bitExperts` with `load_in_4bit`, FP8 `Fp8Experts` with
`load_in_fp8` (biases stay in the model dtype), all through `jaxft.models.quant_experts.expert_matmul`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxft.config import ModelConfig
from jaxft.models.layers import logical
from jaxft.models.moe import GroupedExperts
from kernels_pallas.glu import clamped_swiglu


def route_top_k_softmax(x: jax.Array, router: jax.Array, bias: jax.Array, top_k: int):
    """(logits [N, E], weights [N, k], experts [N, k] int32): top-k of the biased logits, softmax over those k
    (in the logits' dtype, as transformers)."""
    logits = jnp.einsum("nh,he->ne", x, router.astype(x.dtype)) + bias.astype(x.dtype)
    values, experts = jax.lax.top_k(logits, top_k)
    return logits, jax.nn.softmax(values, axis=-1), experts.astype(jnp.int32)


class GptOssMoeMLP(GroupedExperts):
    """Biased router + E experts with fused interleaved gate/up and biases (see the module docstring).

    Parameters ([in, out] like `Linear.kernel`, with the layer stack in front): router [H, E], router_bias [E],
    gate_up_proj [E, H, 2I], gate_up_bias [E, 2I], down_proj [E, I, H], down_bias [E, H]. Expert adapters
    (`ExpertLora`) sit in `gate_up_lora` / `down_lora`, as for `jaxft.models.moe.MoeMLP`."""

    EXPERT_BIASES = True

    def __init__(self, cfg: ModelConfig, *, stack, dtype, rngs):
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        lead = self._experts(cfg, stack, dtype, rngs)
        self.router_bias = nnx.Param(jnp.zeros((*stack, e), dtype), **logical(*lead, "experts"))
        self.gate_up_bias = nnx.Param(jnp.zeros((*stack, e, 2 * i), dtype), **logical(*lead, "experts", "mlp"))
        self.down_bias = nnx.Param(jnp.zeros((*stack, e, h), dtype), **logical(*lead, "experts", "embed"))
        self.limit, self.alpha = float(cfg.swiglu_limit), float(cfg.swiglu_alpha)

    def route_rows(self, xf):
        return route_top_k_softmax(xf, self.router[...], self.router_bias[...], self.top_k)

    def activate(self, gate_up):
        return clamped_swiglu(gate_up, self.limit, self.alpha)
