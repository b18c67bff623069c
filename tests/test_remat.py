"""Rematerialisation policies (jaxft.memory.policy): parsing and its one-line errors, gradients equal to no remat's for
each way a policy reaches the program, in both layer loops (Llama and Gemma 2, packed rows), the named attention
residuals that spare the kernel forward, and the host offload present per layer in both loops (jaxpr and the
CUDA-lowered StableHLO: the CPU backend lowers no memory placement, so only the GPU test shows the compiled copies and
their memory)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxft.config import ModelConfig
from jaxft.memory.execution import ExecutionConfig, ExecutionConfigError
from jaxft.lora import LoraConfig, apply_lora
from jaxft.models import init_model
from jaxft.memory.policy import RematPolicy, canonical, parse
from jaxft.train.step import loss_and_grad_sums, split_model, stack_micro_batches, unstack_layers
from lora_helpers import perturb_lora_b

def llama(layers: int = 2, head_dim: int = 16) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=layers,
                       num_heads=2, num_kv_heads=1, head_dim=head_dim)


LLAMA = llama()
GEMMA = ModelConfig(model_type="gemma2", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=16, layer_windows=(24, None), attn_logit_softcap=5.0,
                    final_logit_softcap=8.0, query_pre_attn_scalar=16.0)
POLICIES = ("full", "offload", "offload+attn", "offload=layer_input,attn_out,attn_lse",
            "save=attn_out,mlp_gate_up;offload=layer_input")


def packed_batch(vocab: int, b: int = 2, t: int = 64, seed: int = 0) -> dict[str, np.ndarray]:
    """[b, t] rows of three documents and padding, loss on the documents' next tokens."""
    rng = np.random.default_rng(seed)
    lengths = (20, 25, 13)
    seg = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(t - sum(lengths))])
    seg = np.repeat(seg[None], b, 0).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lengths] + [np.arange(t - sum(lengths))])
    ids = rng.integers(0, vocab, (b, t)).astype(np.int32)
    mask = ((seg > 0) & (np.roll(seg, -1, 1) == seg)).astype(np.float32)
    mask[:, -1] = 0
    return dict(input_ids=ids, targets=np.roll(ids, -1, 1), loss_mask=mask, segment_ids=seg,
                positions=np.repeat(pos[None], b, 0).astype(np.int32))


def lora_split(cfg: ModelConfig):
    model = apply_lora(init_model(cfg, dtype=jnp.float32, seed=0), LoraConfig(r=4, alpha=8), seed=1)
    perturb_lora_b(model)  # B = 0 would make every A gradient zero
    return split_model(model)


def grads(cfg, split, remat: str, loop: str, attention: str = "reference", **execution):
    graphdef, lora, frozen = split
    frozen = unstack_layers(frozen) if loop == "unroll" else frozen
    batch = stack_micro_batches(packed_batch(cfg.vocab_size), 1)
    ex = ExecutionConfig(attention_implementation=attention, remat=remat, layer_loop=loop, **execution)
    loss, g, _ = jax.jit(lambda lo, fz, b: loss_and_grad_sums(graphdef, lo, fz, b, None, ex))(lora, frozen, batch)
    return float(loss), jax.tree.leaves(g)


def assert_grads_match(loss: float, g: list, loss0: float, g0: list, scale_tol: float = 2e-6) -> None:
    """The loss to 1e-6 relative and each gradient leaf to `scale_tol` (2e-6) of its largest entry (fp32:
    checkpointed layers fuse differently, so a few sums round in another order); every reference leaf nonzero, so
    none is vacuous."""
    assert abs(loss - loss0) <= 1e-6 * abs(loss0)
    assert len(g) == len(g0) > 0
    for a, b in zip(g, g0):
        scale = float(np.max(np.abs(b)))
        assert scale > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=scale_tol * scale)


# ---------------------------------------------------------------------------------------------- parsing
def test_policy_strings_and_mappings_are_canonical():
    assert canonical("offload+attn") == "offload+attn"
    assert canonical({"offload": ["layer_input"], "save": ["attn_out", "attn_lse"]}) == \
        "save=attn_out,attn_lse;offload=layer_input"
    assert canonical(" offload = layer_input ; save=attn_out") == "save=attn_out;offload=layer_input"
    assert parse("offload+attn") == RematPolicy("names", ("attn_out", "attn_lse"), ("layer_input",))
    assert parse("offload") == RematPolicy("names", offload=("layer_input",))
    assert parse("save=mlp_input").jax_policy is not None and not parse("save=mlp_input").offloads
    assert ExecutionConfig(remat={"save": ["attn_out"]}).remat == "save=attn_out"
    assert hash(ExecutionConfig(remat="save=attn_out")) == hash(ExecutionConfig(remat={"save": "attn_out"}))


@pytest.mark.parametrize("value, needle", [
    ("fulll", "value 'fulll' is not a policy; one of 'none', 'full'"),
    ("save=attn_outt", "unknown residual name 'attn_outt' in save; valid names: attn_out, attn_lse, layer_input"),
    ({"keep": ["attn_out"]}, "mapping key 'keep' is not 'save' or 'offload'"),
    ("save=attn_out;save=layer_input", "expected 'save=NAME,...;offload=NAME,...' (each part once)"),
    ("save=attn_out;offload=attn_out", "'attn_out' is both saved and offloaded"),
])
def test_bad_policies_get_one_line_naming_the_key_and_the_valid_names(value, needle):
    with pytest.raises(ExecutionConfigError) as info:
        ExecutionConfig(remat=value)
    text = str(info.value)
    assert text.startswith("key 'remat': ") and needle in text and "\n" not in text


def test_train_config_reports_a_bad_policy_at_its_line(tmp_path):
    from jaxft.train import TrainConfigError, load_config
    from test_train_fixtures import make_jsonl, make_tiny_model

    model = make_tiny_model(tmp_path / "m", hidden=32, layers=1)
    make_jsonl(tmp_path / "d.jsonl", 4)
    path = tmp_path / "run.yaml"
    path.write_text(f"model_name_or_path: {model}\ndataset: {tmp_path / 'd.jsonl'}\noutput_dir: {tmp_path / 'o'}\n"
                    "remat: {save: [attn_out], offload: [layer_inputs]}\n")
    with pytest.raises(TrainConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}:4: key 'remat': ") and "'layer_inputs'" in str(info.value)
    assert load_config(path, ["remat={save: [attn_out], offload: [layer_input]}"]).execution_config.remat == \
        "save=attn_out;offload=layer_input"


# ---------------------------------------------------------------------------------------------- gradients
@pytest.fixture(scope="module")
def no_remat():
    """family, loop -> (config, split model, (loss, gradients) of no remat), each computed once when first asked."""
    splits, wants = {}, {}

    def case(family: str, loop: str):
        cfg = {"llama": LLAMA, "gemma2": GEMMA}[family]
        if family not in splits:
            splits[family] = lora_split(cfg)
        split = splits[family]
        if (family, loop) not in wants:
            wants[family, loop] = grads(cfg, split, "none", loop)
        return cfg, split, wants[family, loop]
    return case


# One case per way a policy reaches the program, in each loop. On the CPU an offloading policy is a plain remat (the
# placements are identities), so its gradients differ from another policy of the same way only by what XLA fuses:
# whole-layer recompute (full), named residuals saved and offloaded by jax.checkpoint (the scan: one policy that does
# both; an offload-only one is test_keeping_everything_but_gate_up_recomputes_only_gate_up's), and, unrolled, named
# residuals kept through jaxft.memory.offload's custom VJP (offload+attn: more names to the host are the same custom
# VJP over a larger residual set).
# Full remat on unrolled layers is test_remat_layers' (on some of them); plain offload in both loops is the explicit
# tests' below (the unrolled loop takes the explicit transfer). Where the copies go and what they cost is checked on
# lowered programs here and on the GPU (test_remat_gpu.py). Gemma 2 (groups of one window each, softcaps) takes the
# scan's case of named residuals saved and offloaded (Llama's scan offloads named residuals in
# test_keeping_everything_but_gate_up_recomputes_only_gate_up): its unrolled layers are Llama's mechanism with another
# mask, and the policies are Llama's cases.
GRADIENT_CASES = [("llama", "scan", "full"), ("llama", "unroll", "offload+attn"),
                  ("gemma2", "scan", "save=attn_out,mlp_gate_up;offload=layer_input")]


@pytest.mark.parametrize("family, loop, remat", GRADIENT_CASES)
def test_every_policy_gives_the_gradients_of_no_remat(no_remat, family, remat, loop):
    """fp32, packed rows of three documents. The recompute repeats the forward's operations on the same
    values, but XLA fuses a program with checkpoints (and the unrolled loop's CSE barriers) differently from the
    no-remat one, so a few fp32 sums round in another order: agreement to 2e-6 of each gradient's largest
    entry (measured: 0 for full/offload in the scan, up to 1.2e-6 elsewhere - Gemma 2 unrolled full/offload;
    main's unrolled full remat was already at 1.0e-6)."""
    cfg, split, (want_loss, want_grads) = no_remat(family, loop)
    loss, got = grads(cfg, split, remat, loop)
    assert len(got) == len(want_grads) == 14
    assert abs(loss - want_loss) <= 1e-6 * abs(want_loss)
    for g, w in zip(got, want_grads):
        scale = float(np.max(np.abs(w)))
        assert scale > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-6 * scale)


def test_unrolled_layers_give_the_gradients_of_the_layer_scan(no_remat):
    """unstack_layers' per-layer weight buffers, layers unrolled, are the same math as the scan over stacked
    weights: same loss, same LoRA gradients, no remat. (Unstacking and restacking: tests/test_train_step.py; the
    unrolled path over several layer runs of a periodic stack against its period scan:
    test_model_structure::test_a_run_of_one_kind_in_a_period_is_an_inner_scan.)"""
    _, _, (l_scan, g_scan) = no_remat("llama", "scan")
    _, _, (l_unr, g_unr) = no_remat("llama", "unroll")
    assert abs(l_unr - l_scan) <= 1e-6 * abs(l_scan)
    assert len(g_scan) == len(g_unr) == 14
    for a, b in zip(g_scan, g_unr):
        scale = float(np.max(np.abs(a)))
        assert scale > 0  # fp32, differently fused: agreement to rounding, relative to the gradient's size
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5 * scale)


def test_explicit_offload_in_the_scan_gives_the_gradients_of_no_remat(no_remat):
    """remat "offload" with `offload_transfer: explicit` in the layer scan (`jaxft.memory.scan_offload`, Llama's one
    group); lowered for a GPU, each layer input goes to pinned host once and comes back once (2 layers: the loop's
    first and the last after it). A period of several layers: the same transfer over Gemma 3's period in
    test_model_structure::test_explicit_offload_in_the_scan_takes_a_period_with_runs_of_layers (gradients) and
    test_offload_scan::test_a_period_of_several_layers_equals_the_plain_scan (placements)."""
    cfg, split, (want_loss, want_grads) = no_remat("llama", "scan")
    loss, got = grads(cfg, split, "offload", "scan", offload_transfer="explicit")
    assert abs(loss - want_loss) <= 1e-6 * abs(want_loss)
    for g, w in zip(got, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-6 * float(np.max(np.abs(w))))
    graphdef, lora, frozen = split
    batch = stack_micro_batches(packed_batch(cfg.vocab_size), 1)
    ex = ExecutionConfig(attention_implementation="reference", remat="offload", layer_loop="scan",
                         offload_transfer="explicit")
    fn = jax.jit(lambda lo, fz, b: loss_and_grad_sums(graphdef, lo, fz, b, None, ex)[1])
    hlo = fn.trace(lora, frozen, batch).lower(lowering_platforms=("cuda",)).as_text()
    assert cfg.num_layers == 2
    # the forward loop's body and its last iteration; back: before the backward loop and in its body
    assert hlo.count('_xla_buffer_placement = "pinned_host"') == 2
    assert hlo.count('_xla_buffer_placement = "device"') == 2


# ---------------------------------------------------------------------------------------------- named residuals
def _flash_forward_loops(remat: str) -> int:
    """While loops of the Pallas flash forward kernel (interpret mode on CPU: a loop over its grid) in the
    compiled gradient of a 1-layer model. Compiled, because the jaxpr still lists a recomputation that the
    saved residuals made dead; XLA removes it."""
    import re

    cfg = llama(1, head_dim=64)  # a head size the Pallas kernels support
    graphdef, lora, frozen = lora_split(cfg)
    batch = stack_micro_batches(packed_batch(cfg.vocab_size), 1)
    ex = ExecutionConfig(attention_implementation="pallas", remat=remat, layer_loop="scan")
    text = jax.jit(lambda lo: loss_and_grad_sums(graphdef, lo, frozen, batch, None, ex)[1]).lower(lora).compile()
    return sum(1 for line in text.as_text().splitlines()
               if re.search(r"= .*\bwhile\(", line) and "jaxft_flash_fwd" in line)


@pytest.mark.slow  # two CPU compilations of interpret-mode kernels
def test_keeping_the_attention_residuals_never_reruns_the_flash_forward():
    """The kernel's forward runs once where its output and statistics are kept (offload+attn), twice where the
    statistics are not (save=attn_out: recomputed in the backward, as under full remat or offload). Each count is
    once or twice the forward's, so twice the other's pins both."""
    kept = _flash_forward_loops("offload+attn")
    assert kept > 0
    assert _flash_forward_loops("save=attn_out") == 2 * kept


def _dots(split, remat: str) -> int:
    """Matmuls in the jaxpr of the LoRA loss and gradients (Llama, the layer scan: one layer body), after JAX's
    partial evaluation left out of the backward's recompute what it does not need (XLA's own passes may merge
    dots that share an operand, so the optimized program's count is not structural)."""
    from lora_helpers import jaxpr_eqns

    graphdef, lora, frozen = split
    batch = stack_micro_batches(packed_batch(LLAMA.vocab_size), 1)
    ex = ExecutionConfig(attention_implementation="reference", remat=remat, layer_loop="scan")
    jaxpr = jax.make_jaxpr(lambda lo: loss_and_grad_sums(graphdef, lo, frozen, batch, None, ex)[1])(lora)
    return sum(1 for eqn in jaxpr_eqns(jaxpr.jaxpr) if eqn.primitive.name == "dot_general")


def test_keeping_everything_but_gate_up_recomputes_only_gate_up(no_remat):
    """A selective policy: with q/k/v, the attention's residuals and the MLP input kept (here offloaded), the
    backward re-runs six matmuls of a layer: gate and up, each with its LoRA A and B; no attention, q/k/v/o or down
    projection. Full remat re-runs more. Gradients equal no remat's."""
    policy = "offload=layer_input,attn_out,attn_lse,attn_qkv,mlp_input"
    _, split, (want_loss, want) = no_remat("llama", "scan")
    assert _dots(split, policy) == _dots(split, "none") + 6 < _dots(split, "full")
    assert_grads_match(*grads(LLAMA, split, policy, "scan"), want_loss, want)


def test_named_vjp_keeps_values_gradients_and_spares_the_forward():
    """The wrapper used for cuDNN (tested here around the reference): same output and gradients; under a policy
    that keeps its names, the wrapped function's forward appears once in the gradient's jaxpr."""
    from kernels_pallas.attention.reference import attention_reference
    from kernels_pallas.attention.residuals import named_vjp

    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (1, 16, 2, 8))
    k, v = (jax.random.normal(key, (1, 16, 1, 8)) for key in ks[1:3])
    ct = jax.random.normal(ks[3], q.shape)
    wrapped = named_vjp(lambda q, k, v: jnp.tanh(attention_reference(q, k, v)))

    def plain(q, k, v):
        return jnp.tanh(attention_reference(q, k, v))

    out, back = jax.vjp(wrapped, q, k, v)
    want_out, want_back = jax.vjp(plain, q, k, v)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    for g, w in zip(back(ct), want_back(ct)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

    def loss(policy, q):
        return jnp.sum(jax.checkpoint(lambda q: jnp.sin(wrapped(jnp.cos(q), k, v)), policy=policy)(q))

    def tanh_count(policy) -> int:
        return str(jax.make_jaxpr(jax.grad(lambda q: loss(policy, q)))(q)).count("= tanh ")

    keep = jax.checkpoint_policies.save_only_these_names("attn_out", "attn_lse")
    assert tanh_count(keep) == 1 and tanh_count(jax.checkpoint_policies.nothing_saveable) == 2


def test_named_vjp_takes_segment_ids_made_inside_a_layer_scan():
    """The cuDNN path wraps attention whose segment ids are computed per batch and reach each layer inside the
    layer scan (the Qwen2-VL tower's image segments): passed as an argument they are no closed-over tracer, so
    the gradient traces (closing over them leaked the scan body's tracer) and equals the unwrapped one."""
    from kernels_pallas.attention.reference import attention_reference
    from kernels_pallas.attention.residuals import named_vjp

    q = jax.random.normal(jax.random.key(1), (3, 1, 16, 2, 8))
    seg = jnp.array([[1] * 8 + [2] * 8], jnp.int32)

    def loss(q, attend):
        def body(c, qq):
            s = seg + (c > 1e9).astype(jnp.int32)  # made in the body, as the tower's per-image segments are
            return c + jnp.sum(jnp.sin(attend(qq, s))), None
        return jax.lax.scan(body, 0.0, q)[0]

    wrapped = named_vjp(lambda q, k, v, s: attention_reference(q, k, v, segment_ids=s, causal=False))
    got = jax.jit(jax.grad(lambda q: loss(q, lambda qq, s: wrapped(qq, qq, qq, s))))(q)
    want = jax.jit(jax.grad(lambda q: loss(q, lambda qq, s: attention_reference(qq, qq, qq, segment_ids=s,
                                                                               causal=False))))(q)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert float(jnp.max(jnp.abs(want))) > 0


# ---------------------------------------------------------------------------------------------- host offload
@functools.cache
def _offload_texts(loop: str, remat: str, transfer: str = "auto") -> tuple[str, str]:
    """(jaxpr, CUDA-lowered StableHLO) of the LoRA gradient of a 3-layer Llama under `remat`, one trace each: the
    placement and barrier tests below share the programs they both read."""
    cfg = llama(3)
    graphdef, lora, frozen = _llama3_split()
    frozen = unstack_layers(frozen) if loop == "unroll" else frozen
    batch = stack_micro_batches(packed_batch(cfg.vocab_size), 1)
    ex = ExecutionConfig(attention_implementation="reference", remat=remat, layer_loop=loop, offload_transfer=transfer)
    traced = jax.jit(lambda lo, fz, b: loss_and_grad_sums(graphdef, lo, fz, b, None, ex)[1]).trace(lora, frozen, batch)
    return str(traced.jaxpr), traced.lower(lowering_platforms=("cuda",)).as_text()


@functools.cache
def _llama3_split():
    return lora_split(llama(3))


def _placements_back(loop: str, remat: str) -> int:
    """Placements on the device per offloaded residual. Unrolled, a policy that keeps more than the layer input
    runs its vjp inside jaxft.memory.offload's custom VJP, which copies the host residuals back itself (one layer early,
    PrefetchChain); the vjp's own placement then reads a value already on the device (a second annotation, which
    compiles to no copy: compiled for an H200, one copy back per residual)."""
    return 2 if loop == "unroll" and not parse(remat).explicit_capable else 1


@pytest.mark.parametrize("loop", ["scan", "unroll"])
@pytest.mark.parametrize("remat, per_layer", [("offload", 1), ("offload+attn", 1),
                                              ("offload=layer_input,attn_out,attn_lse", 2)])
def test_offload_policies_place_residuals_in_host_memory_in_both_loops(loop, remat, per_layer):
    """Per layer: `per_layer` values go to pinned host (the layer input, and the attention output where named: the
    reference attention has no statistics) and come back for the backward. The scan's body is one layer (one
    annotation per name), the unrolled program has one per layer."""
    jaxpr, hlo = _offload_texts(loop, remat)
    layers = 1 if loop == "scan" else 3
    to_host = hlo.count('_xla_buffer_placement = "pinned_host"')
    to_device = hlo.count('_xla_buffer_placement = "device"')
    assert to_host == to_device // _placements_back(loop, remat) and to_host > 0 and to_host % layers == 0
    assert to_host == per_layer * layers
    assert jaxpr.count("devices=(MemorySpace.Host,)") == to_host


# ---------------------------------------------------------------------------------------------- explicit transfer
def test_explicit_offload_gives_the_gradients_of_no_remat(no_remat):
    """jaxft.memory.offload (the layer input to host in a custom VJP, full recompute from the copy; unrolled layers,
    the copies back chained one layer ahead): the gradients of no remat, as every policy (same tolerance and
    reason as above)."""
    cfg, split, (want_loss, want_grads) = no_remat("llama", "unroll")
    loss, got = grads(cfg, split, "offload", "unroll", offload_transfer="explicit")
    assert abs(loss - want_loss) <= 1e-6 * abs(want_loss)
    for g, w in zip(got, want_grads):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-6 * float(np.max(np.abs(w))))


def _host_barriers(jaxpr: str) -> int:
    """Optimization barriers with a host-memory value among their results (the explicit transfer's, one each way)."""
    return sum(1 for line in jaxpr.splitlines() if "optimization_barrier" in line and "<host>" in line)


@pytest.mark.parametrize("transfer, loop, barriers", [("auto", "unroll", 6), ("auto", "scan", 0), ("policy", "unroll", 0),
                                                      ("explicit", "unroll", 6)])
def test_the_copy_back_of_an_explicit_offload_waits_behind_a_barrier(transfer, loop, barriers):
    """With the explicit transfer every copy back to the device reads an optimization barrier that holds the host
    copy and the layer's output cotangent (what keeps XLA from folding the copy pair, jaxft.memory.offload), and the
    forward's host copy is held with the layer output (two host barriers per layer); `auto` takes it in the
    unrolled loop only. Still one placement each way per layer (the scan: one body)."""
    jaxpr, hlo = _offload_texts(loop, "offload", transfer)
    assert _host_barriers(jaxpr) == barriers
    layers = 3 if loop == "unroll" else 1
    assert hlo.count('_xla_buffer_placement = "pinned_host"') == hlo.count('_xla_buffer_placement = "device"') == layers
    if barriers:
        # `%12 = stablehlo.custom_call @annotate_device_placement(%11#0) {... "device"}` with %11 a barrier's result
        results = {m.group(1) for m in re.finditer(r"(%\d+):\d+ = stablehlo.optimization_barrier", hlo)}
        backs = re.findall(r"@annotate_device_placement\((%\d+)#\d+\)[^\n]*_xla_buffer_placement = \"device\"", hlo)
        assert len(backs) == layers and set(backs) <= results


def test_offload_transfer_is_validated_and_carried_by_the_layer_policy():
    with pytest.raises(ExecutionConfigError, match="key 'offload_transfer': value 'manual' is not one of"):
        ExecutionConfig(offload_transfer="manual")
    # A policy's explicit copies stacked by a scan fail XLA's layout assignment on the GPU; remat "offload" alone
    # runs in the scan through jaxft.memory.scan_offload.
    with pytest.raises(ExecutionConfigError, match=r"^key 'offload_transfer': 'explicit' in the layer scan takes "
                                                   r"remat: offload only \(got 'offload\+attn'"):
        ExecutionConfig(remat="offload+attn", offload_transfer="explicit", layer_loop="scan")
    ExecutionConfig(remat="offload", offload_transfer="explicit", layer_loop="scan")
    assert ExecutionConfig(remat="offload", offload_transfer="explicit").resolved_layer_loop == "unroll"
    ex = ExecutionConfig(remat="offload", offload_transfer="explicit")
    assert ex.layer_policy(LLAMA, 1, 64, 4).transfer == "explicit" and hash(ex) != hash(ex.replace(offload_transfer="auto"))
    assert parse("offload").explicit_capable and not parse("offload+attn").explicit_capable


def test_an_offloading_policy_in_the_scan_compiles_with_pipelined_host_offload(no_remat):
    """`ExecutionConfig.program_options`: XLA's pipelined host offloading for a policy that offloads in the layer
    scan (its forward copies to the host then run beside the next layer), not where that scan is
    `offloaded_scan`'s, nothing added elsewhere, and the user's
    own `compiler_options` win. The step compiles with it (CPU: the placements are identities there)."""
    flag = "xla_gpu_enable_pipelined_host_offloading"
    scan = dict(layer_loop="scan")
    off = {flag: True, "xla_gpu_enable_command_buffer": ""}  # no command buffers either: they serialised the copies
    for remat in ("offload", "offload+attn", "offload=layer_input,attn_out,attn_lse",
                  "save=attn_out;offload=layer_input"):
        assert ExecutionConfig(remat=remat, **scan).program_options == off, remat
    for remat, loop in (("full", "scan"), ("none", "auto"), ("offload", "unroll"), ("save=attn_out", "scan")):
        assert flag not in ExecutionConfig(remat=remat, layer_loop=loop).program_options, (remat, loop)
    assert ExecutionConfig(remat="offload", layer_loop="auto").program_options == off  # auto: the scan
    # jaxft.memory.scan_offload's own loop (streamed weights, the explicit transfer): its fetches stay copies
    # unpipelined ... and, again, without command buffers
    for ours in (ExecutionConfig(remat="offload", frozen_weights="host", **scan),
                 ExecutionConfig(remat="offload", offload_transfer="explicit", **scan)):
        assert flag not in ours.program_options and ours.program_options["xla_gpu_enable_command_buffer"] == ""
    mine = ExecutionConfig(remat="offload", compiler_options={flag: False, "xla_gpu_enable_command_buffer": ""}, **scan)
    assert mine.program_options == {flag: False, "xla_gpu_enable_command_buffer": ""}
    cfg, (graphdef, lora, frozen), _ = no_remat("llama", "scan")
    batch = stack_micro_batches(packed_batch(cfg.vocab_size), 1)
    ex = ExecutionConfig(attention_implementation="reference", remat="offload", **scan)
    step = jax.jit(lambda lo, fz, b: loss_and_grad_sums(graphdef, lo, fz, b, None, ex)[0],
                   compiler_options=ex.program_options)
    assert np.isfinite(float(step(lora, frozen, batch)))
