"""`moe_expert_out` (jaxft.memory.policy): a mixture of experts' down-projection output per sorted row, which the
combine's backward reads for the router weights' gradient. Kept with `mlp_gate_up`, the experts' backward recomputes no
grouped matmul; the gradients are those of no remat. GPT-OSS (its activation a custom VJP between the two named
values; both families name them in the same sparse block, jaxft.models.moe), expert LoRA on both expert weights."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from jaxft.config import ModelConfig
from jaxft.memory.execution import ExecutionConfig
from jaxft.lora import LoraConfig, apply_lora
from jaxft.models import init_model
from jaxft.memory.policy import MOE_EXPERT_OUT, residual_bytes
from jaxft.train import load_config
from jaxft.train.step import loss_and_grad_sums, split_model, stack_micro_batches, token_loss_sum
from lora_helpers import jaxpr_eqns, perturb_lora_b
from test_remat import LLAMA, assert_grads_match, grads, packed_batch

GPT_OSS = ModelConfig.from_hf(transformers.GptOssConfig(
    vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=24,
    max_position_embeddings=256).to_dict())
# The experts' residuals kept on the device, the layer input and the MLP input too; what is left to recompute is
# the attention side (norms, projections, the attention forward), the router and the elementwise expert ops.
KEEP_EXPERTS = f"save=layer_input,mlp_input,mlp_gate_up,{MOE_EXPERT_OUT}"
RANK = 4  # below every width of the models above


@pytest.fixture(scope="module")
def case():
    cfg = GPT_OSS
    model = init_model(cfg, dtype=jnp.float32, seed=0)
    model = apply_lora(model, LoraConfig(r=RANK, alpha=8, target_parameters=("experts.gate_up_proj",
                                                                           "experts.down_proj")), seed=1)
    perturb_lora_b(model)  # B = 0 would make every A gradient zero
    return cfg, split_model(model)


def _program(cfg, split, remat: str):
    graphdef, lora, frozen = split
    batch = stack_micro_batches(packed_batch(cfg.vocab_size), 1)
    ex = ExecutionConfig(attention_implementation="reference", remat=remat, layer_loop="scan",
                         grouped_matmul_implementation="xla")
    return (lambda lo: loss_and_grad_sums(graphdef, lo, frozen, batch, None, ex)), lora


def _wide_grouped_matmuls(cfg, split, remat: str) -> int:
    """Ragged dots of the experts' width in the gradient's jaxpr (forward, backward, and what the backward
    recomputes: partial evaluation leaves out of the recompute what the backward does not read). The adapters'
    rank-r products (an operand or the output RANK wide) are left out: cheap, and recomputed under any policy that
    does not name them."""
    fn, lora = _program(cfg, split, remat)
    jaxpr = jax.make_jaxpr(lambda lo: fn(lo)[1])(lora)
    return sum(1 for eqn in jaxpr_eqns(jaxpr.jaxpr) if eqn.primitive.name.startswith("ragged_dot")
               and RANK not in (eqn.invars[0].aval.shape[-1], eqn.invars[1].aval.shape[-1]))


def test_keeping_the_experts_residuals_recomputes_no_grouped_matmul(case):
    cfg, split = case
    none = _wide_grouped_matmuls(cfg, split, "none")
    assert none > 0
    assert _wide_grouped_matmuls(cfg, split, KEEP_EXPERTS) == none
    # Without the experts' output the combine's backward needs the down product again; without either name,
    # gate/up's too.
    without_out = _wide_grouped_matmuls(cfg, split, "save=layer_input,mlp_input,mlp_gate_up")
    assert none < without_out < _wide_grouped_matmuls(cfg, split, "save=layer_input,mlp_input")


def test_keeping_the_experts_residuals_gives_the_gradients_of_no_remat(case):
    """Kept on the device; offloading the same names is the same program on the CPU (its placements are
    identities there), so one policy serves; one family (GPT-OSS: biases, clamps and interleaved gate/up around the
    same named expert residuals), as each remat mechanism has one CPU gradient test."""
    cfg, split = case
    run = functools.partial(grads, cfg, split, loop="scan", grouped_matmul_implementation="xla")
    assert_grads_match(*run(KEEP_EXPERTS), *run("none"))


def test_expert_outputs_are_counted_per_chosen_expert():
    sizes = residual_bytes(GPT_OSS, 2, 64, 2)
    assert sizes[MOE_EXPERT_OUT] == 2 * 64 * GPT_OSS.num_experts_per_tok * GPT_OSS.hidden_size * 2
    assert residual_bytes(LLAMA, 2, 64, 2)[MOE_EXPERT_OUT] == 0  # a dense model keeps none



def test_the_keep_experts_recipe_runs_the_policy_tested_here():
    recipe = Path(__file__).resolve().parents[1] / "examples" / "bench" / "keep_experts.yaml"
    ex = load_config(recipe).execution_config
    assert (ex.remat, ex.layer_loop) == (KEEP_EXPERTS, "scan")


def test_no_remat_keeps_one_activation_of_the_expert_width_per_gpt_oss_layer():
    """Without remat the layer scan keeps what each layer's backward reads. Of GPT-OSS's clamped SwiGLU, through its
    custom VJP, that is the gate/up product (the expert rows [N k, 2I]) and the activation [N k, I] the down
    projection reads; autodiff of the activation kept its strided halves, the clamps' comparisons, the sigmoid and
    two products besides: nine [N k, I] tensors a layer here (the activation's "reference" implementation). A
    hidden size other than I tells the [N k, H] rows apart."""
    cfg = ModelConfig.from_hf(transformers.GptOssConfig(
        vocab_size=64, hidden_size=48, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=24,
        max_position_embeddings=256).to_dict())
    model = apply_lora(init_model(cfg, dtype=jnp.float32, seed=0), LoraConfig(
        r=RANK, alpha=8, target_parameters=("experts.gate_up_proj", "experts.down_proj")), seed=1)
    graphdef, lora, frozen = split_model(model)
    batch = {k: jnp.asarray(v) for k, v in packed_batch(cfg.vocab_size).items()}
    ex = ExecutionConfig(attention_implementation="reference", remat="none", layer_loop="scan",
                         grouped_matmul_implementation="xla")
    kept = saved_residuals(lambda lo: token_loss_sum(nnx.merge(graphdef, lo, frozen), batch, execution=ex), lora)
    rows = int(np.prod(batch["input_ids"].shape)) * cfg.num_experts_per_tok
    width = cfg.moe_intermediate_size

    def count(last: int) -> int:  # stacked by the layer scan: [reps, rows, last] (ragged_dot's loop-invariant
        # zero buffers of the same size are kept once, unstacked)
        return sum(1 for aval, _ in kept if aval.shape[1:] == (rows, last))

    assert count(width) == cfg.num_layers  # the activation, once a layer
    assert count(2 * width) == cfg.num_layers  # the gate/up product
