"""Qwen3-MoE on the GPU: the bf16 LoRA step whose grouped matmuls are the Mosaic GPU kernels ("auto" on Hopper)
matches the same step on `lax.ragged_dot` ("xla") in loss and LoRA gradients, and the kernels are in the compiled
step.

Both steps load the same bf16 weights and read the same 512-token row with the same attention (the reference:
only the grouped matmul differs), so the first layer routes identically; attention LoRA and expert LoRA
(`target_parameters`, B perturbed) are trained, so the kernels' d lhs and d rhs are both in the gradients."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.grouped_matmul import mosaic
from gpu_helpers import compile_no_autotune

pytestmark = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")

SEQ = 512
CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=384, moe_intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
              max_position_embeddings=4096, tie_word_embeddings=False, norm_topk_prob=True)
LORA = dict(r=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=["experts.gate_up_proj", "experts.down_proj"])
MOSAIC_CALL = r'custom_call_target="mosaic_gpu_v2"'
# Per scanned layer body: 3 forward grouped matmuls (gate+up and down, each with its adapter's B side in its kernel,
# and the down adapter's grouped A; the gate/up adapter's A is dense over the tokens: `ExpertLora`), 5 d lhs (gate+up,
# down, the two fused adapters' xa, the down adapter's A; 4 once FUSED_DLHS_LORA_ON_GPU fuses the last into down's),
# and at least the 3 grouped adapter factors' d rhs (both B, the down adapter's A; the frozen experts' d rhs may be
# dropped as dead code). Where an adapter's tiles do not fit, its B side is a kernel more.
MIN_KERNELS = 3 + (4 if mosaic.FUSED_DLHS_LORA_ON_GPU else 5) + 3


def batch_of(seq: int = SEQ, vocab: int = CONFIG["vocab_size"], seed: int = 0) -> dict:
    ids = np.random.default_rng(seed).integers(0, vocab, (1, seq + 1))
    return dict(input_ids=jnp.asarray(ids[:, :-1]), targets=jnp.asarray(ids[:, 1:]),
                loss_mask=jnp.ones((1, seq), jnp.float32), segment_ids=jnp.ones((1, seq), jnp.int32), positions=None)


def loss_and_grads(path, implementation: str, batch: dict, compile_fn=compile_no_autotune, remat: str = "none"):
    """(loss, LoRA gradients as fp32 numpy, compiled HLO text) of one bf16 value-and-grad step over the layer scan,
    each layer rematerialised per `remat`."""
    from flax import nnx

    import jaxft
    from jaxft import lora
    from jaxft.memory.execution import ExecutionConfig
    from jaxft.train.step import token_loss_sum
    from lora_helpers import perturb_lora_b

    model = lora.apply_lora(jaxft.from_pretrained(path, dtype="bfloat16", verbose=False), lora.LoraConfig(**LORA))
    perturb_lora_b(model)
    graphdef, params, rest = nnx.split(model, lora.trainable_filter, ...)
    # The layer scan: one body, so each distinct kernel is compiled once.
    execution = ExecutionConfig(attention_implementation="reference", remat=remat, layer_loop="scan",
                                grouped_matmul_implementation=implementation)

    def loss_fn(p, b):
        return token_loss_sum(nnx.merge(graphdef, p, rest), b, execution=execution) / b["loss_mask"].sum()

    step = compile_fn(jax.value_and_grad(loss_fn), params, batch)
    loss, grads = step(params, batch)
    return float(loss), [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)], step.as_text()


@needs_gpu
def test_qwen3_moe_bf16_step_on_the_mosaic_kernels_matches_ragged_dot(tmp_path):
    from lora_helpers import rel_err, tiny_qwen3_moe

    path = tmp_path / "qwen3_moe"
    tiny_qwen3_moe(CONFIG).save_pretrained(path)
    batch = batch_of()
    loss, grads, hlo = loss_and_grads(path, "auto", batch)
    want_loss, want_grads, want_hlo = loss_and_grads(path, "xla", batch)
    kernels = re.findall(MOSAIC_CALL, hlo)
    assert len(kernels) >= MIN_KERNELS, re.findall(r'custom_call_target="[^"]+"', hlo)
    assert not re.findall(MOSAIC_CALL, want_hlo)
    assert loss == pytest.approx(want_loss, rel=5e-3)
    assert len(grads) == len(want_grads)
    for g, w in zip(grads, want_grads):
        # bf16 gradients, two grouped matmuls with other accumulation orders and a second layer that may route a
        # near-tie token differently: the same step on CPU with the masked-dense reference against ragged_dot
        # differs by up to 7e-2 (loss by 2e-5); a wrong group, row or transpose is O(1).
        assert rel_err(g, w) < 1e-1


GPT_OSS_LAYERS = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, num_local_experts=8, num_experts_per_tok=2, vocab_size=512,
                      max_position_embeddings=4096)


def _mosaic_operand_shapes(hlo: str) -> list[tuple[int, ...]]:
    """The bf16 operand shapes of every Mosaic GPU custom call of a compiled HLO text. The compiled text names an
    instruction's operands without their shapes (`custom-call(%bitcast.3, %fusion.2)`), so each name is looked up
    where it is defined (`%bitcast.3 = bf16[32,256,512]{2,1,0} bitcast(...)`; names are unique in a module)."""
    defined = dict(re.findall(r"^\s*(?:ROOT )?%(\S+) = bf16\[([\d,]+)\]", hlo, re.M))
    shapes = []
    for line in hlo.splitlines():
        if "mosaic_gpu_v2" in line and "custom-call(" in line:
            operands = line.split("custom-call(", 1)[1].split("), custom_call_target", 1)[0]
            shapes += [tuple(map(int, defined[name].split(","))) for name in re.findall(r"%([\w.\-]+)", operands)
                       if name in defined]
    return shapes


def test_mosaic_operand_shapes_reads_the_shapes_where_the_operands_are_defined():
    hlo = """  %param_0 = bf16[64,256]{1,0} parameter(0)
  %bitcast.3 = bf16[32,256,512]{2,1,0} bitcast(%param_1)
  %iota.1 = s32[8]{0} iota(), iota_dimension=0
  ROOT %custom-call.2 = bf16[64,512]{1,0} custom-call(%param_0, %bitcast.3, %iota.1), custom_call_target="mosaic_gpu_v2"
  %other = bf16[4,4]{1,0} custom-call(%param_0), custom_call_target="cublas"
"""
    assert _mosaic_operand_shapes(hlo) == [(64, 256), (32, 256, 512)]


@needs_gpu
def test_scanned_gpt_oss_layers_read_the_expert_stacks_in_place_under_offload(tmp_path):
    """The lean recipe's loop (a scan over periods of sliding + full layers, remat "offload"): the kernels read the
    frozen expert stacks in place, flattened to [L * E, in, out] (`StackRow`, grouped_matmul(row=)); no kernel
    operand is one layer's [E, in, out] copy of them (XLA copies a scanned slice out whole before a custom call:
    1.48 GiB a layer at GPT-OSS-20B). Loss and LoRA gradients match the same step on ragged_dot."""
    from lora_helpers import rel_err
    from test_gpt_oss import gpt_oss_model

    path = tmp_path / "gpt_oss"
    gpt_oss_model(seed=3, **GPT_OSS_LAYERS).save_pretrained(path)
    batch = batch_of(vocab=GPT_OSS_LAYERS["vocab_size"])
    loss, grads, hlo = loss_and_grads(path, "pallas_mosaic", batch, remat="offload")
    want_loss, want_grads, _ = loss_and_grads(path, "xla", batch, remat="offload")
    h, i, e, layers = (GPT_OSS_LAYERS[k] for k in ("hidden_size", "intermediate_size", "num_local_experts",
                                                   "num_hidden_layers"))
    shapes = set(_mosaic_operand_shapes(hlo))
    assert {(layers * e, h, 2 * i), (layers * e, i, h)} <= shapes, sorted(shapes)
    assert not {(e, h, 2 * i), (e, i, h)} & shapes, sorted(shapes)
    assert loss == pytest.approx(want_loss, rel=5e-3)
    assert len(grads) == len(want_grads) and all(rel_err(g, w) < 1e-1 for g, w in zip(grads, want_grads))
