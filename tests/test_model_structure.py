"""Structural properties of the decoder's program: what is computed once per batch stays out of the layer loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxft.config import ModelConfig
from jaxft.memory.execution import ExecutionConfig
from jaxft.models import init_model, positions_from_segments
from lora_helpers import jaxpr_eqns

CFG = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=3,
                  num_heads=2, num_kv_heads=1, head_dim=64, qkv_bias=True, layer_windows=(None, 16, 16))


def _scan_bodies(jaxpr):
    for eqn in jaxpr_eqns(jaxpr):
        if eqn.primitive.name == "scan":
            yield eqn.params["jaxpr"].jaxpr


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_batch_metadata_is_built_once_outside_the_layer_scan(impl):
    model = init_model(CFG, dtype=jnp.float32)
    graphdef, state = nnx.split(model)
    ids = jnp.zeros((2, 64), jnp.int32)
    seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 30 + [0] * 14], 2, 0), jnp.int32)
    execution = ExecutionConfig(attention_implementation=impl)
    jaxpr = jax.make_jaxpr(lambda s, i, g: nnx.merge(graphdef, s)(i, segment_ids=g, execution=execution))(
        state, ids, seg).jaxpr
    bodies = list(_scan_bodies(jaxpr))
    # Two runs of layers (full, then sliding) -> two scans over stacked layers.
    assert len(bodies) == 2
    top = [str(e.source_info.name_stack) for e in jaxpr_eqns(jaxpr)]
    assert any("batch_context" in n for n in top)
    for body in bodies:
        names = [str(e.source_info.name_stack) for e in jaxpr_eqns(body)]
        prims = {e.primitive.name for e in jaxpr_eqns(body)}
        assert not any("batch_context" in n for n in names)
        # RoPE tables (sin/cos) and positions (cummax) come from outside the loop.
        assert not {"sin", "cos", "cummax"} & prims, prims


def test_positions_restart_per_segment():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0]])
    assert positions_from_segments(seg).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


def test_backward_keeps_only_the_needed_activations():
    """Per layer, a LoRA step keeps gate and up ([T, I], not silu(gate)*up), the layer input and the
    post-attention residual ([T, H]), q/k/v and the attention output -- no fp32 copies of hidden states,
    no normed states (recomputed in the backward pass). Guards the activation-memory work of
    experiments/probes/residual_memory.py against regressions."""
    import collections

    from jax._src.ad_checkpoint import saved_residuals  # the list behind the public print_saved_residuals

    from jaxft.lora import LoraConfig, apply_lora
    from jaxft.train.step import split_model, token_loss_sum

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=384, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=64)
    model = apply_lora(init_model(cfg, dtype=jnp.bfloat16), LoraConfig(r=4, alpha=8))
    graphdef, lora, frozen = split_model(model)
    t = 256
    batch = dict(input_ids=jnp.zeros((1, t), jnp.int32), targets=jnp.zeros((1, t), jnp.int32),
                 loss_mask=jnp.ones((1, t)), segment_ids=jnp.ones((1, t), jnp.int32),
                 positions=jnp.arange(t)[None])
    pallas = ExecutionConfig(attention_implementation="pallas")
    residuals = saved_residuals(lambda l: token_loss_sum(nnx.merge(graphdef, l, frozen), batch, execution=pallas),
                                lora)
    per_layer = collections.Counter((str(a.dtype), a.shape[1:]) for a, src in residuals
                                    if "scan" in src and a.shape and a.shape[0] == cfg.num_layers)
    assert per_layer[("bfloat16", (1, t, 384))] == 2  # gate, up
    assert per_layer[("bfloat16", (1, t, 128))] == 2  # layer input, post-attention residual
    assert per_layer[("bfloat16", (1, t, 2, 64))] == 2  # q and the attention output
    assert per_layer[("bfloat16", (1, t, 1, 64))] == 2  # k, v
    assert not [k for k in per_layer if k[0] == "float32" and k[1][-1] in (128, 384)]  # no fp32 activations


def test_unrolled_training_step_never_touches_stacked_frozen_weights():
    """With per-layer weight buffers (unstack_layers) no operation of the training step reads a stacked
    [L, ...] frozen array: no per-layer slicing copy exists to be made (on the H200 those copies cost ~20 ms
    per step at 8B in the scanned program) and no layer loop remains. The scanned step, for contrast, loops."""
    from jaxft.lora import LoraConfig, apply_lora
    from jaxft.train import make_optimizer, make_train_step, split_model, unstack_layers

    model = init_model(CFG, dtype=jnp.float32, seed=0)
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"), seed=0)
    graphdef, lora, frozen = split_model(model)
    stacked_shapes = {tuple(v.get_value().shape) for p, v in nnx.to_flat_state(frozen) if p[0] == "layers"}
    assert stacked_shapes and all(s[0] == CFG.num_layers for s in stacked_shapes)
    step = make_train_step(graphdef, make_optimizer(1e-3), donate=False)
    t = 64
    batch = {k: jnp.zeros((1, 1, t), jnp.int32) for k in ("input_ids", "targets", "segment_ids", "positions")}
    batch["loss_mask"] = jnp.ones((1, 1, t), jnp.float32)
    opt_state = make_optimizer(1e-3).init(lora)

    def reads_stacked(fz):
        jaxpr = jax.make_jaxpr(step)(lora, opt_state, fz, batch, jax.random.key(0)).jaxpr
        eqns = list(jaxpr_eqns(jaxpr))
        touching = [e.primitive.name for e in eqns for v in e.invars
                    if hasattr(v, "aval") and tuple(getattr(v.aval, "shape", ())) in stacked_shapes]
        # CFG's windows (None, 16, 16) make two layer runs: a scan of length 2 is the windowed run's loop.
        layer_loops = [e for e in eqns if e.primitive.name == "scan" and e.params["length"] == 2]
        return touching, layer_loops

    touching, loops = reads_stacked(unstack_layers(frozen))
    assert touching == [] and loops == []
    touching, loops = reads_stacked(frozen)
    assert touching and loops  # the scan consumes the stacked weights


def test_gemma3_builds_both_rope_tables_once_outside_the_layer_groups():
    """Gemma 3: local (sliding) and global RoPE tables, and one attention block table per window, are made once
    per batch; the groups (2 sliding, 1 global, 1 sliding) scan without computing any of them."""
    cfg = ModelConfig(model_type="gemma3_text", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=4,
                      num_heads=1, num_kv_heads=1, head_dim=64, qk_norm=True, layer_windows=(16, 16, None, 16),
                      layer_ropes=("local", "local", "global", "local"),
                      rope=ModelConfig.from_hf(dict(model_type="llama", vocab_size=1, hidden_size=1,
                                                    intermediate_size=1, num_attention_heads=1,
                                                    num_hidden_layers=1, rope_theta=1e6)).rope,
                      rope_local=CFG.rope)
    model = init_model(cfg, dtype=jnp.float32)
    graphdef, state = nnx.split(model)
    ids = jnp.zeros((1, 64), jnp.int32)
    seg = jnp.ones((1, 64), jnp.int32)
    execution = ExecutionConfig(attention_implementation="pallas")
    jaxpr = jax.make_jaxpr(lambda s, i, g: nnx.merge(graphdef, s)(i, segment_ids=g, execution=execution))(
        state, ids, seg).jaxpr
    top = [e for e in jaxpr_eqns(jaxpr) if "batch_context" in str(e.source_info.name_stack)]
    assert sum(e.primitive.name == "cos" for e in top) == 2  # one table per RoPE kind
    bodies = list(_scan_bodies(jaxpr))
    assert len(bodies) == 3  # one scan per group: (sliding, local) x2, (full, global), (sliding, local)
    for body in _scan_bodies(jaxpr):
        assert not {"sin", "cos", "cummax"} & {e.primitive.name for e in jaxpr_eqns(body)}


def test_alternating_stack_scans_over_periods_without_weight_copies():
    """Gemma 2's alternation (sliding, global, ...) over stacked weights is ONE scan of L // 2 steps whose body
    is a (sliding, global) pair, not L scans of one layer each (each of those sliced the stack and kept its
    own copy for the backward: 54 GiB for the 9B lean step on the H200 against 38 GiB unrolled). Five layers: two
    whole periods and an incomplete last one. The program's numbers: the period scan of Gemma 2's alternation (with
    an incomplete last period) against transformers' logits and PEFT's LoRA gradients in
    test_gemma::test_logits_match_transformers / test_lora_gradients_equal_peft [gemma2]; a period scan under
    full remat against the unrolled layers in test_a_run_of_one_kind_in_a_period_is_an_inner_scan."""
    from jaxft.lora import LoraConfig, apply_lora
    from jaxft.models.stack import layer_groups, layer_period
    from jaxft.train import split_model
    from jaxft.train.step import token_loss_sum

    num_layers = 5
    windows = tuple(16 if i % 2 == 0 else None for i in range(num_layers))
    cfg = ModelConfig(model_type="gemma2", vocab_size=64, hidden_size=64, intermediate_size=64,
                      num_layers=num_layers, num_heads=2, num_kv_heads=1, head_dim=32, layer_windows=windows,
                      attn_logit_softcap=5.0)
    assert layer_period(layer_groups(cfg)) == 2
    model = init_model(cfg, dtype=jnp.float32, seed=0)
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"), seed=0)
    graphdef, lora, frozen = split_model(model)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, (1, 49)))
    batch = dict(input_ids=ids[:, :-1], targets=ids[:, 1:], loss_mask=jnp.ones((1, 48)),
                 segment_ids=jnp.asarray(np.repeat([1, 2], [20, 28])[None]), positions=None)
    def loss(lr, fz, remat="full"):
        execution = ExecutionConfig(attention_implementation="reference", remat=remat)
        return token_loss_sum(nnx.merge(graphdef, lr, fz), batch, execution=execution)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(lora, frozen).jaxpr
    lengths = sorted(e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan")
    # forward and backward: the period scan (L // 2 steps) and, for odd L, the last layer's own scan
    assert lengths == sorted([num_layers // 2] * 2 + [1] * 2 * (num_layers % 2))
    # The forward period scan stacks, for the backward, the layer inputs alone: never a copy of a layer's frozen
    # weights (each position slices its row of the period's block inside its checkpoint; sliced before the
    # call, the rows were stacked residuals: a second copy of every layer's weights, 0.38 GiB a Gemma-2-9B
    # layer). The frozen weights here are [64, 64] (q, o, gate, up, down) and [64, 32] (k, v) per layer.
    weight_rows = {(64, 64), (64, 32)}
    stacked = [v.aval.shape for e in jaxpr.eqns if e.primitive.name == "scan" and e.params["length"] > 1
               for v in e.outvars if v.aval.shape[1:] in weight_rows]
    assert stacked == [], f"the period scan stacks weight copies {stacked}"


@pytest.fixture(scope="module")
def period_case():
    """Gemma 3's period (five sliding layers, then one global), here (sliding, sliding, global) x 2, with LoRA on
    every linear; and its loss and LoRA gradients through the unrolled layers without remat (a policy changes what
    is saved, not the values): one reference program for every policy."""
    from jaxft.lora import LoraConfig, apply_lora
    from jaxft.models.stack import layer_groups, layer_period
    from jaxft.train import split_model, unstack_layers

    windows = (16, 16, None) * 2
    cfg = ModelConfig(model_type="gemma3_text", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=6,
                      num_heads=2, num_kv_heads=1, head_dim=32, layer_windows=windows,
                      layer_ropes=tuple("local" if w else "global" for w in windows), qk_norm=True,
                      rope=ModelConfig.from_hf(dict(model_type="llama", vocab_size=1, hidden_size=1,
                                                    intermediate_size=1, num_attention_heads=1,
                                                    num_hidden_layers=1, rope_theta=1e6)).rope,
                      rope_local=CFG.rope)
    assert layer_period(layer_groups(cfg)) == 3
    model = init_model(cfg, dtype=jnp.float32, seed=0)
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"), seed=0)
    graphdef, lora, frozen = split_model(model)
    lora = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(1), a.shape, a.dtype), lora)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, 49)))
    batch = dict(input_ids=ids[:, :-1], targets=ids[:, 1:], loss_mask=jnp.ones((1, 48)),
                 segment_ids=jnp.asarray(np.repeat([1, 2], [20, 28])[None]), positions=None)

    def loss(lr, fz, remat, **options):
        from jaxft.train.step import token_loss_sum

        execution = ExecutionConfig(attention_implementation="reference", remat=remat, **options)
        return token_loss_sum(nnx.merge(graphdef, lr, fz), batch, execution=execution)

    want = jax.jit(jax.value_and_grad(lambda lr, fz: loss(lr, fz, "none")))(lora, unstack_layers(frozen))
    return loss, lora, frozen, want


@pytest.mark.parametrize("remat, inner", [("full", True), ("offload+attn", False)])
def test_a_run_of_one_kind_in_a_period_is_an_inner_scan(period_case, remat, inner):
    """Under a policy that keeps its residuals on the device the two sliding positions of the period
    (`period_case`) run as an inner scan inside the period scan, so the backward recomputes them one at a time
    (compiled for an H200, Gemma-3-12B, 48 layers at 16k, full remat: temp 21.25 -> 13.63 GiB); a policy that
    offloads keeps one call per position (stacked host buffers in two loops fail XLA's layout assignment). Loss and
    LoRA gradients of the inner scan equal the unrolled layers'."""
    from lora_helpers import rel_err

    loss, lora, frozen, (want_loss, want) = period_case
    jaxpr = jax.make_jaxpr(jax.grad(lambda lr, fz: loss(lr, fz, remat)))(lora, frozen).jaxpr
    outer = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert outer and all(e.params["length"] == 2 for e in outer)  # the period scans (2 periods of 3 layers)
    nested = [e.params["length"] for s in outer for e in jaxpr_eqns(s.params["jaxpr"].jaxpr)
              if e.primitive.name == "scan"]
    # the sliding pair's scan (length 2) in the forward that saves the residuals and in the backward
    assert nested == ([2, 2] if inner else []), nested
    if not inner:  # one call per position in the period scan, as Gemma 2's: its numbers under a policy that
        return  # offloads are test_remat::test_every_policy_gives_the_gradients_of_no_remat[gemma2-scan-...]
    got_loss, got = jax.jit(jax.value_and_grad(lambda lr, fz: loss(lr, fz, remat)))(lora, frozen)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # fp32, different fusions: rounding only
        assert rel_err(np.asarray(a), np.asarray(b)) < 1e-5


def test_explicit_offload_in_the_scan_takes_a_period_with_runs_of_layers(period_case):
    """remat offload with `offload_transfer: explicit` in the layer scan (`jaxft.memory.scan_offload`) over the
    period with a run of two sliding layers (`period_case`): the offloaded scan calls each position on its own (an
    inner scan over the run would take a block and a row); loss and LoRA gradients equal the unrolled layers'."""
    from lora_helpers import rel_err

    loss, lora, frozen, (want_loss, want) = period_case
    fn = jax.jit(jax.value_and_grad(lambda lr, fz: loss(lr, fz, "offload", offload_transfer="explicit",
                                                        layer_loop="scan")))
    got_loss, got = fn(lora, frozen)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6)
    assert len(jax.tree.leaves(got)) == len(jax.tree.leaves(want)) > 0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # fp32, different fusions: rounding only
        assert rel_err(np.asarray(a), np.asarray(b)) < 1e-5
