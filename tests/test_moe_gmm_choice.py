"""`grouped_matmul_implementation` (ExecutionConfig field and flat `jaxft-train` key): validated once in one line,
and it reaches every grouped matmul of a MoE training step (tiny Qwen3-MoE and GPT-OSS, CPU, fp32).

Checks: a bad name is one line naming the key and the valid names (ExecutionConfig, and TrainConfig at its YAML
line); the flat key, the command line and `to_dict` carry it into the execution config; a LoRA step (attention
LoRA + expert LoRA through `target_parameters`, B perturbed) gives the same loss and LoRA gradients with
"reference" and "xla" (and "pallas_mosaic": its kernels' values in tests/test_grouped_matmul.py); and the traced step
has exactly the grouped matmuls asked for: no ragged dot under "reference", ragged dots only under "xla", the
Mosaic kernels' wgmma under "pallas_mosaic" - so a call that ignored the setting (the forward, the expert LoRA
products, the 4-bit experts' dequantise-then-gmm forward or its custom-VJP backward) would show as a ragged dot.
"""

from __future__ import annotations

import collections
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxft
from jaxft import lora
from jaxft.memory.execution import ExecutionConfig, ExecutionConfigError
from kernels_pallas.grouped_matmul import OP
from lora_helpers import jaxpr_eqns, perturb_lora_b, rel_err, tiny_qwen3_moe

QWEN = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=1024, tie_word_embeddings=False, norm_topk_prob=True)
LORA = dict(r=4, alpha=8, target_modules=["q_proj", "v_proj"],
            target_parameters=["experts.gate_up_proj", "experts.down_proj"])
RAGGED, MOSAIC = "ragged_dot_general", "wgmma_ref"  # lax.ragged_dot; the Mosaic kernels' MMA (interpreted)
MESSAGE = ("key 'grouped_matmul_implementation': value 'mosaic' is not one of 'reference', 'xla', 'pallas_mosaic', "
           "'auto'")


def _saved(family, path, layers):
    if family == "qwen3_moe":
        model = tiny_qwen3_moe({**QWEN, "num_hidden_layers": layers})
    else:
        from test_gpt_oss import gpt_oss_model

        model = gpt_oss_model(seed=2, num_hidden_layers=layers)
    model.save_pretrained(path)
    return path


def _batch(vocab, t, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (1, t + 1))
    seg = np.repeat([1, 2], [t // 2, t - t // 2])[None].astype(np.int32)  # two documents: packed rows
    return dict(input_ids=jnp.asarray(ids[:, :-1]), targets=jnp.asarray(ids[:, 1:]),
                loss_mask=jnp.ones((1, t), jnp.float32), segment_ids=jnp.asarray(seg), positions=None)


def _step(path, batch, implementation, *, run=True, remat="none", transfer="auto", scatters=None, **load):
    """(loss, LoRA gradients, primitive counts of the traced step) of one value-and-grad with that grouped matmul
    (loss and gradients None unless `run`); `remat = (policy, list)` also appends the step's HLO lowered for CUDA
    to the list; `scatters` (a list) gets the operand shape of every scatter of the traced step."""
    from jaxft.train.step import token_loss_sum

    model = lora.apply_lora(jaxft.from_pretrained(path, dtype="float32", verbose=False, **load),
                            lora.LoraConfig(**LORA))
    perturb_lora_b(model)
    graphdef, params, rest = nnx.split(model, lora.trainable_filter, ...)
    remat, hlo = (remat, None) if isinstance(remat, str) else remat
    execution = ExecutionConfig(attention_implementation="reference", grouped_matmul_implementation=implementation,
                                remat=remat, offload_transfer=transfer,
                                layer_loop="auto" if transfer == "auto" else "scan")

    def loss_fn(p, b):
        return token_loss_sum(nnx.merge(graphdef, p, rest), b, execution=execution) / b["loss_mask"].sum()

    traced = jax.jit(jax.value_and_grad(loss_fn)).trace(params, batch)
    eqns = list(jaxpr_eqns(traced.jaxpr.jaxpr))
    counts = collections.Counter(e.primitive.name for e in eqns)
    if scatters is not None:
        scatters.extend(e.invars[0].aval.shape for e in eqns if e.primitive.name.startswith("scatter"))
    if hlo is not None:
        hlo.append(traced.lower(lowering_platforms=("cuda",)).as_text())
    if not run:
        return None, None, counts
    loss, grads = traced.lower().compile()(params, batch)
    return float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)], counts


def _assert_same(got, want, tol):
    loss, grads, _ = got
    want_loss, want_grads, _ = want
    assert loss == pytest.approx(want_loss, rel=tol)
    assert len(grads) == len(want_grads) and all(rel_err(g, w) < tol for g, w in zip(grads, want_grads))


# ------------------------------------------------------------------------------------------------ the setting
def test_a_bad_name_is_one_line_naming_the_key_and_the_valid_names():
    with pytest.raises(ExecutionConfigError) as info:
        ExecutionConfig(grouped_matmul_implementation="mosaic")
    assert str(info.value) == MESSAGE and info.value.field == "grouped_matmul_implementation"
    assert ExecutionConfig().grouped_matmul_implementation == "auto"
    for name in OP.accepted:  # every name the op accepts, and only those
        assert ExecutionConfig(grouped_matmul_implementation=name).grouped_matmul_implementation == name
    assert hash(ExecutionConfig(grouped_matmul_implementation="xla")) != hash(ExecutionConfig())


def test_the_flat_key_reaches_the_execution_config(tmp_path):
    from jaxft.train import TrainConfig, TrainConfigError, load_config
    from jaxft.train.keys import BY_NAME
    from test_train_fixtures import make_jsonl, make_tiny_model

    key = BY_NAME["grouped_matmul_implementation"]
    assert set(typing.get_args(key.type)) == set(OP.accepted)  # the key's choices are the op's names
    head = (f"model_name_or_path: {make_tiny_model(tmp_path / 'm', hidden=32, layers=1)}\n"
            f"dataset: {make_jsonl(tmp_path / 'd.jsonl', 4)}\noutput_dir: {tmp_path / 'o'}\n")
    path = tmp_path / "run.yaml"
    path.write_text(head + "grouped_matmul_implementation: xla\n")
    cfg = load_config(path)
    assert cfg.execution_config.grouped_matmul_implementation == "xla"
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg  # what train_config.json holds
    chosen = load_config(path, ["grouped_matmul_implementation=reference"]).execution_config
    assert chosen.grouped_matmul_implementation == "reference"
    path.write_text(head + "grouped_matmul_implementation: mosaic\n")
    with pytest.raises(TrainConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}:4: key 'grouped_matmul_implementation': value 'mosaic' is not one of 'auto', "
                               "'reference', 'xla', 'pallas_mosaic'; did you mean 'pallas_mosaic'?")


def test_the_log_says_how_the_mosaic_kernels_run_on_a_mesh():
    """`jaxft-train`'s notes on the Mosaic expert kernels on a mesh of several devices (`ExecutionConfig.describe`):
    per device (moe_dispatch auto / per_device) one info line; with moe_dispatch global one warning naming the key
    and the fix (XLA cannot partition their custom call); nothing on one device or without them."""
    import logging

    def notes(mosaic: bool, devices: int, dispatch: str = "auto") -> list[tuple[int, str]]:
        return ExecutionConfig(layer_loop="scan", moe_dispatch=dispatch).describe(
            None, rows=1, seq=1, itemsize=4, devices=devices, mosaic_experts=mosaic)

    [(level, line)] = notes(True, 2, "global")
    assert level == logging.WARNING and "moe_dispatch: global" in line and "set moe_dispatch: per_device" in line
    [(level, line)] = notes(True, 2)
    assert level == logging.INFO and "run per device on the mesh of 2 devices (moe_dispatch auto" in line
    assert notes(True, 1) == [] and notes(False, 8) == [] and notes(False, 8, "global") == []


# ------------------------------------------------------------------------------------------------ the step
# 1 layer and 32 tokens in two documents: what Mosaic GPU's interpreter compiles in tens of seconds (it compiles
# every kernel call: 6-7 forward, twice as many backward); the reference and xla steps of the same config are
# shared by the tests (module fixture).
@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def steps(request, tmp_path_factory):
    path = _saved(request.param, tmp_path_factory.mktemp(request.param), 1)
    batch = _batch(128, 32)
    return dict(family=request.param, path=path, batch=batch, reference=_step(path, batch, "reference"),
                xla=_step(path, batch, "xla"))


def test_reference_and_xla_steps_agree_and_run_what_they_name(steps):
    ref, xla = steps["reference"], steps["xla"]
    _assert_same(xla, ref, 1e-5)
    assert ref[2][RAGGED] == 0 and ref[2][MOSAIC] == 0
    # Every grouped matmul of the xla step is a ragged dot: forward and backward of the experts and expert LoRA.
    # expert projections (gate+up, down in both families), the gate/up adapter's B side (its A is dense over the
    # tokens: ExpertLora) and both of the down adapter's sides
    gmms = 5
    assert xla[2][RAGGED] >= 2 * gmms and xla[2][MOSAIC] == 0
    assert _step(steps["path"], steps["batch"], "auto", run=False)[2] == xla[2]  # off the GPU "auto" is ragged_dot


def test_the_step_moves_no_activation_rows_by_scatter(steps):
    """Both families route by gathers both ways (jaxft.models.moe.gather_tokens, combine): no scatter of the step
    writes rows of the hidden width (autodiff of x[token] would scatter-add d xs into the tokens, with atomics).
    The scatters left are the inverse permutation, the router's counts and the expert adapters' [N, E, r]."""
    shapes = []
    _step(steps["path"], steps["batch"], "xla", run=False, scatters=shapes)
    hidden = jaxft.from_pretrained(steps["path"], dtype="float32", verbose=False).config.hidden_size
    assert shapes and not [s for s in shapes if len(s) > 1 and s[-1] == hidden], shapes


# Traced, not run: the model has no code of its own per implementation (the setting is passed to every grouped
# matmul), so the step's values under "pallas_mosaic" are its kernels' with `lora=` / `adapter=` / `row=`, which
# tests/test_grouped_matmul.py checks against the definition in Mosaic GPU's interpreter (forward and custom VJP);
# the whole step against ragged_dot natively: tests/test_moe_gpu.py. One family: the kernels see the same expert
# stacks and adapters in both; GPT-OSS adds its biases and clamps around them.
@pytest.mark.parametrize("steps", ["gpt_oss"], indirect=True)
def test_pallas_mosaic_step_runs_the_mosaic_kernels_for_every_grouped_matmul(steps):
    mosaic = _step(steps["path"], steps["batch"], "pallas_mosaic", run=False)
    # Each grouped product has an MMA in its forward, d lhs and d rhs kernels; an adapter fused into the experts'
    # forward (both adapters' B side) adds one to that kernel and has its own d lhs and d rhs. Products, in both
    # families: the expert projections (gate+up, down) and the adapters' (the two fused B sides and the down
    # adapter's grouped A).
    products = 5
    assert mosaic[2][RAGGED] == 0 and mosaic[2][MOSAIC] == 3 * products


@pytest.mark.parametrize("steps", ["qwen3_moe"], indirect=True)  # the saved model and batch
def test_the_4bit_experts_forward_and_backward_take_the_setting(steps):
    """Qwen3-MoE with its experts in NF4: the dequantise-then-gmm custom VJP's forward and backward grouped matmuls
    follow the setting (no ragged dot at all under "reference"). Traced, not run: each grouped matmul's values under
    either setting are test_reference_and_xla_steps_agree_and_run_what_they_name's, and the 4-bit experts' logits
    and expert-LoRA gradients (under this CPU's "auto", ragged_dot) equal the dequantised dense model's in
    test_quant_experts::test_logits_and_expert_lora_gradients_equal_the_dequantised_dense_model."""
    path, batch = steps["path"], steps["batch"]
    ref, xla = (_step(path, batch, name, run=False, quantize="nf4") for name in ("reference", "xla"))
    assert ref[2][RAGGED] == 0
    # 3 expert forwards + their 3 custom-VJP backwards (d lhs only: the 4-bit weight is frozen) + the adapters' 2
    # grouped forwards and their backwards.
    assert xla[2][RAGGED] >= 3 + 3 + 2 * 2


# ------------------------------------------------------------------------------------------------ the layer scan
@pytest.fixture(scope="module")
def gpt_oss_4_layers(tmp_path_factory):
    """GPT-OSS in 4 layers: 2 periods of sliding + full attention, a layer scan of 2 steps."""
    return _saved("gpt_oss", tmp_path_factory.mktemp("gpt_oss_4"), 4)


def test_a_layer_scan_reads_the_expert_stacks_in_place(gpt_oss_4_layers):
    """In the scan over 4 GPT-OSS layers (2 periods of sliding + full) the expert stacks [L, E, in, out] are not
    scanned over (a scanned slice handed to the Mosaic kernels' custom call is copied out whole first) but passed
    whole, each layer's kernels reading its row from a base index (`StackRow`, grouped_matmul(row=)): no slice of a
    stack anywhere in the step, forward or backward, and the kernels' operand is the flattened stack. Under "xla"
    the same stacks are sliced inside the layer (where XLA fuses the slice into its own ops). Traced without remat,
    for two reasons: that is where a slice would be saved for the backward (a second copy of every layer's experts;
    here the whole stack is the residual, read in place), and the Mosaic GPU interpreter's callbacks are effects,
    which jax.checkpoint's AD rejects (the remat policies on the kernels: tests/test_moe_gpu.py)."""
    from jaxft.train.step import token_loss_sum

    remat = "none"
    path = gpt_oss_4_layers
    model = lora.apply_lora(jaxft.from_pretrained(path, dtype="float32", verbose=False), lora.LoraConfig(**LORA))
    stacks = {tuple(v.shape) for _, v in nnx.to_flat_state(nnx.state(model))
              if type(v).__name__ == "ExpertParam"}
    assert len(stacks) == 2 and all(s[0] == 4 for s in stacks)
    graphdef, params, rest = nnx.split(model, lora.trainable_filter, ...)
    batch = _batch(128, 32)

    def eqns_for(implementation):
        execution = ExecutionConfig(attention_implementation="reference", grouped_matmul_implementation=implementation,
                                    layer_loop="scan", remat=remat)

        def loss_fn(p, b):
            return token_loss_sum(nnx.merge(graphdef, p, rest), b, execution=execution) / b["loss_mask"].sum()

        return list(jaxpr_eqns(jax.jit(jax.value_and_grad(loss_fn)).trace(params, batch).jaxpr.jaxpr))

    def sliced(eqns):
        return [e for e in eqns if e.primitive.name in ("dynamic_slice", "slice", "gather", "squeeze")
                and tuple(e.invars[0].aval.shape) in stacks]

    eqns = eqns_for("pallas_mosaic")
    scans = [e for e in eqns if e.primitive.name == "scan" and e.params["length"] == 2]
    assert scans
    def split(scan):
        """(inputs read whole, scanned inputs) of a scan equation: a scanned input's slice in the body lacks its
        leading axis; a constant or a carry has the same shape in the body."""
        pairs = list(zip(scan.invars, scan.params["jaxpr"].jaxpr.invars))
        return ([v for v, b in pairs if v.aval.shape == b.aval.shape],
                [v for v, b in pairs if v.aval.shape != b.aval.shape])

    for scan in scans:
        assert not any(v.aval.ndim == 4 and tuple(v.aval.shape[1:]) in {s[1:] for s in stacks} for v in split(scan)[1])
    assert any(tuple(v.aval.shape) in stacks for scan in scans for v in split(scan)[0])
    assert not sliced(eqns)
    flat = {(s[0] * s[1], *s[2:]) for s in stacks}
    assert any(e.primitive.name == "reshape" and tuple(e.outvars[0].aval.shape) in flat for e in eqns)

    def saved_weights(eqns):
        """Stacked residuals of the layer scans (outputs [steps, ...]) that are one layer's expert matrices: without
        remat, what a scanned slice leaves for the backward is a second copy of every layer's experts (GPT-OSS-20B:
        24 x 1.48 GiB, most of the 67 GiB temp `fast.yaml` was once refused for)."""
        layer = {s[1:] for s in stacks}
        return [v.aval.shape for e in eqns if e.primitive.name == "scan" and e.params["length"] == 2
                for v in e.outvars if tuple(v.aval.shape[1:]) in layer]

    assert not saved_weights(eqns)
    xla = eqns_for("xla")
    assert sliced(xla) and saved_weights(xla)


def test_a_policy_can_keep_the_experts_gate_up_off_the_device(steps):
    """The sparse blocks name their gate/up rows (`mlp_gate_up`, as the dense MLP): a selective policy that offloads
    them sends them to pinned host (the fused [N*k, 2I] rows, in both families), so the backward
    does not rerun those grouped matmuls; the loss and gradients stay those of no remat."""
    placed = {}
    for remat in ("offload", "offload=layer_input,mlp_gate_up"):
        hlo = []
        # the selective policy's step runs (the whole "offload" policy's loss and gradients under the same host
        # offload: test_explicit_offload_in_the_scan_keeps_the_moe_gradients and test_remat's); "offload" is
        # lowered for its placements only
        selective = remat != "offload"
        got = _step(steps["path"], steps["batch"], "xla", remat=(remat, hlo), run=selective)
        if selective:
            _assert_same(got, steps["xla"], 1e-5)
        placed[remat] = hlo[0].count('_xla_buffer_placement = "pinned_host"')
    assert placed["offload"] >= 1
    assert placed["offload=layer_input,mlp_gate_up"] == placed["offload"] + 1


def test_explicit_offload_in_the_scan_keeps_the_moe_gradients(gpt_oss_4_layers):
    """remat "offload" through `jaxft.memory.scan_offload` (`offload_transfer: explicit` in the layer scan) on GPT-OSS:
    the expert stacks read in place (closed over), the router statistics in the carry, its period of two layers;
    loss and LoRA gradients equal to no remat."""
    path = gpt_oss_4_layers
    batch = _batch(128, 32)
    want = _step(path, batch, "xla")
    _assert_same(_step(path, batch, "xla", remat="offload", transfer="explicit"), want, 1e-5)
