"""The names the model gives the residuals worth keeping (`jax.ad_checkpoint.checkpoint_name`): what a
rematerialisation policy (`jaxft.memory.policy`) can save on the device or offload to pinned host memory."""

from __future__ import annotations

from kernels_pallas.attention import residuals as attention_residuals

# Residual names, in the order `offload_all` spends its host budget on them: most recompute saved per byte
# first (the attention forward is the costliest recompute at long context; the MLP's gate/up are the largest
# and cheapest to recompute: two matmuls).
LAYER_INPUT, ATTN_OUT, ATTN_LSE = "layer_input", attention_residuals.OUT_NAME, attention_residuals.STATS_NAME
ATTN_QKV, MLP_INPUT, MLP_GATE_UP = "attn_qkv", "mlp_input", "mlp_gate_up"
# A mixture of experts' down projection output, per sorted (token, expert) row before the router weights combine
# them: the combine's backward reads it for the router weights' gradient, so without it the backward re-runs the
# down grouped matmul even where the gate/up output is kept (`mlp_gate_up`). Kept together, the experts' backward
# recomputes no grouped matmul.
MOE_EXPERT_OUT = "moe_expert_out"
# The branch outputs before their output norms (sandwich norms, Gemma 2/3: the norms' backward reads them;
# without those norms the residual add needs neither, so naming them keeps nothing).
ATTN_PROJ, MLP_OUT = "attn_proj", "mlp_out"
# The input of a block of layers under nested checkpointing (`RematPolicy.block`); internal, not a policy name:
# a block's own checkpoint offloads it, while the layers inside name their inputs LAYER_INPUT as always.
BLOCK_INPUT = "block_input"
NAMES = (ATTN_OUT, ATTN_LSE, LAYER_INPUT, MLP_INPUT, ATTN_PROJ, MLP_OUT, ATTN_QKV, MLP_GATE_UP, MOE_EXPERT_OUT)
NAME_HELP = {
    LAYER_INPUT: "the layer's input (residual stream) [B,T,H]",
    ATTN_OUT: "the attention output [B,T,heads,D]",
    ATTN_LSE: "the attention softmax statistics (flash logsumexp [B,heads,T] fp32; cuDNN's stats)",
    ATTN_QKV: "q, k (after norm and RoPE) and v, what the attention kernel reads",
    MLP_INPUT: "the residual stream after attention [B,T,H], the MLP block's input",
    ATTN_PROJ: "the attention branch output (o_proj) before its output norm [B,T,H] (sandwich norms only)",
    MLP_OUT: "the MLP output (down_proj) before its output norm [B,T,H] (sandwich norms only)",
    MLP_GATE_UP: "the MLP's gate and up projections [B,T,intermediate] each",
    MOE_EXPERT_OUT: "a mixture of experts' down projection output per (token, chosen expert) row [B*T*k,H]",
}
