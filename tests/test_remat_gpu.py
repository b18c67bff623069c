"""Remat policies on a GPU, from shapes (nothing trained, nothing allocated but compile scratch): the host offload
is kept in both layer loops (compiled HLO copies to host memory, and device temporaries far below no remat), and
the attention residuals kept by offload+attn spare the kernel forward (cuDNN dense and packed, the Pallas flash
kernel).

Every test here is compile time (about 6-17 s per program on the H200). Only the tests that read compiled memory
sizes are `serial` (gpu_check.sh runs them in their own process beside the others: the critical path of the GPU
suite); the HLO-only attention checks run on the parallel workers at a smaller shape."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxft.config import ModelConfig
from jaxft.memory.execution import ExecutionConfig
from jaxft.lora import LoraConfig, apply_lora
from jaxft.models.decoder import Decoder
from jaxft.train.step import loss_and_grad_sums, split_model, unstack_layers
from gpu_helpers import FAST_COMPILE, NO_AUTOTUNE

pytestmark = pytest.mark.gpu
# serial: the temp sizes depend on the device memory XLA compiles for (gpu_check.sh runs these in one process).
serial = pytest.mark.serial

# 2 layers of Llama-3.2-1B widths at 1 x 2048: one layer's saved activations (~75 MiB) dwarf its input (8 MiB).
# Two layers, not four: the unrolled program's compile time grows with the layers, and two already show the bug
# the unrolled offload test guards (compiled for an H200 target on a CPU before the ordering barriers of
# jaxft.memory.offload, 2 layers: offload temp above no remat; see the comment over the test).
CFG = ModelConfig(model_type="llama", vocab_size=8192, hidden_size=2048, intermediate_size=8192, num_layers=2,
                  num_heads=32, num_kv_heads=8, head_dim=64)
T = 2048
# The HLO-only attention checks (kernel forwards counted, no sizes read): a small model; 1024 tokens keep cuDNN's
# packed (THD) path small (its statistics are [B * T, heads, T] fp32: 65 GiB of temp at CFG and 4 layers).
SMALL_CFG = ModelConfig(model_type="llama", vocab_size=2048, hidden_size=512, intermediate_size=2048, num_layers=2,
                        num_heads=8, num_kv_heads=2, head_dim=64)
SMALL_T = 1024


def _compiled(remat: str, loop: str, attention: str = "cudnn", segments: bool = True, small: bool = False,
              mlp_chunk: int | None = None):
    # One cache key per setting however it is passed: `_compiled("none", "scan", segments=False)` and
    # `_compiled("none", "scan", "cudnn", False, False)` are one program (functools.cache keys on the call's form,
    # and the cuDNN dense case compiled the memory test's three programs again: 38 s of the serial process).
    return _compiled_once(remat, loop, attention, segments, small, mlp_chunk)


@functools.cache  # each setting compiled once per process, whichever test asks first
def _compiled_once(remat: str, loop: str, attention: str, segments: bool, small: bool, mlp_chunk: int | None):
    cfg, t = (SMALL_CFG, SMALL_T) if small else (CFG, T)
    model = nnx.eval_shape(lambda: apply_lora(Decoder(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
                                              LoraConfig(r=16, alpha=32)))
    graphdef, lora, frozen = split_model(model)
    frozen = unstack_layers(frozen) if loop == "unroll" else frozen
    batch = {k: jax.ShapeDtypeStruct((1, 1, t), jnp.float32 if k == "loss_mask" else jnp.int32)
             for k in ("input_ids", "targets", "loss_mask", "segment_ids", "positions")}
    if not segments:  # one document per row: cuDNN's dense kernel (jax.nn.dot_product_attention)
        batch["segment_ids"] = None
    ex = ExecutionConfig(attention_implementation=attention, remat=remat, layer_loop=loop, mlp_chunk_size=mlp_chunk)
    step = jax.jit(lambda lo, fz, b: loss_and_grad_sums(graphdef, lo, fz, b, None, ex)[1])
    # The memory tests read temp sizes, which depend on the GEMM emitter (gpu_helpers): XLA's default emitters.
    # The small programs are only searched for kernel forwards, which the remat policy decides before XLA's GEMM
    # passes: cuBLAS GEMMs there, a shorter compile.
    return step.lower(lora, frozen, batch).compile(compiler_options=FAST_COMPILE if small else NO_AUTOTUNE)


def _host_copies(text: str) -> int:
    """Instructions whose result lives in host memory: memory space 5 in XLA's layout of the result type,
    e.g. `%copy-start = (bf16[..]{2,1,0}, bf16[..]{2,1,0:S(5)}, u32[]) copy-start(...)` (the layout is read
    from the text before the opcode's own parenthesis, which a tuple result type also opens)."""
    count = 0
    for line in text.splitlines():
        _, eq, rhs = line.partition(" = ")
        if eq and ":S(5)}" in re.split(r"\s[a-z][\w-]*\(", rhs, maxsplit=1)[0]:
            count += 1
    return count


# Measured on the H200 (JAX 0.11.2) with segment ids, i.e. cuDNN's ragged (THD) path
# with one slot per token (max_segments = T): there the temp was 67.6 GiB without remat and 65.2 GiB with the scan's
# offload. Read from the source, not yet from a buffer dump (experiments/probes/offload_probe.py prints the largest
# buffers): that path's softmax statistics are [B * max_segments, heads, T] fp32
# (`jax._src.cudnn.fused_attention_stablehlo`), 512 MiB per layer here, and its backward workspace is sized for
# B * T sequences - the bulk of the temp, which no remat policy touches; the 2.4 GiB the offload saved are about
# the four layers' residuals (statistics included). Rows of one document take the dense kernel (attention "auto" does too), so
# the residuals are what temp measures. Unrolled, XLA folded the policy's copy pair (no S(5) value at all); the
# unrolled loop now takes the explicit transfer (`jaxft.memory.offload`, ExecutionConfig.offload_transfer "auto").
# The explicit transfer kept the device temp of no remat (measured at 3fa6ed3 on the H200: 0.535 GiB vs 0.501
# without remat and 0.246 with full remat) until its two ordering barriers (jaxft.memory.offload,
# tests/test_offload_order.py): compiled for an H200 target with Pallas attention, 562 -> 275 MiB (none 615, full 322).
# At 2 layers (this CFG), compiled for an H200 target on a CPU with Pallas attention (experiments/deviceless; cuDNN is
# not there): scan none 474 / full 354 / offload 346 MiB; unrolled 365 / 263 / 233 MiB, and 318 MiB before the
# barriers (5f23f0a^), where this test fails. Compiled with cuBLAS GEMMs (xla_gpu_enable_triton_gemm off) the
# offload saves less than full remat in both loops (scan 405 / 270 / 294, unrolled 376 / 292 / 329 MiB), barriers
# or not: hence NO_AUTOTUNE alone here, XLA's default GEMM emitters as in training.
@serial
@pytest.mark.parametrize("loop", ["scan", "unroll"])
def test_offload_is_kept_in_both_layer_loops(loop):
    temps = {r: _compiled(r, loop, segments=False).memory_analysis().temp_size_in_bytes for r in ("none", "full")}
    offload = _compiled("offload", loop, segments=False)
    temp = offload.memory_analysis().temp_size_in_bytes
    assert _host_copies(offload.as_text()) > 0
    # offload keeps less on the device than full remat (the layer inputs go to the host), so it must save at least
    # (nearly) what full remat saves. Measured at b50b7b0 (H200): scan none 0.654 / offload 0.330 GiB (the fixed
    # part - loss, LoRA gradients - is about half of this small config, so a ratio to `none` is the wrong bound);
    # unrolled none 0.501 / offload 0.535 GiB: the explicit transfer saved nothing there before its barriers.
    # Before the unrolled fix the unrolled offload temp was ABOVE the no-remat temp (13.47 vs 13.08 GB at 8B).
    # Unrolled, the copy back of a layer's input is prefetched one layer ahead (jaxft.memory.offload.PrefetchChain): the
    # next layer's input arrives while this layer's backward runs, beside its staging. On these 2 layers, where full
    # remat's 2 layer inputs are all it keeps, that costs about what the offload spares: measured at de7bcca (H200)
    # none 0.309 / full 0.215 / offload 0.231 GiB, 2.1 layer inputs above full; before the prefetch (b50b7b0) the
    # bound was 90% of full remat's saving. A dropped offload (none's temp) is 12 layer inputs above this bound.
    saved, full_saves = temps["none"] - temp, temps["none"] - temps["full"]
    prefetch = 3 * T * CFG.hidden_size * 2 if loop == "unroll" else 0.1 * full_saves
    assert full_saves > 0 and saved >= full_saves - prefetch, (loop, {k: v / 2**30 for k, v in temps.items()},
                                                               temp / 2**30)


# cuDNN dense shares the layer scan's "none" and "offload" programs with the test above (one more compile in the
# serial process); the packed cuDNN path (THD, segment ids passed through `named_vjp` inside the layer scan) and the
# Pallas kernel compile their own three programs at the small shape on a parallel worker.
ATTENTION_CASES = [pytest.param("cudnn", False, False, id="cudnn_dense", marks=serial),
                   pytest.param("cudnn", True, True, id="cudnn_packed"),
                   pytest.param("pallas", True, True, id="pallas_packed")]


@pytest.mark.parametrize("attention,segments,small", ATTENTION_CASES)
def test_offload_attn_does_not_rerun_the_attention_forward(attention, segments, small):
    pattern = {"cudnn": r"custom_call_target=\"__cudnn\$fmhaSoftmax(?!Backward)", "pallas": r"jaxft_flash_fwd"}[attention]

    def forwards(remat):
        return len(re.findall(pattern, _compiled(remat, "scan", attention, segments, small).as_text()))

    # Counted in the compiled text, where one kernel may be named more than once (call sites, fusion names):
    # full recompute adds kernel forwards, keeping the attention residuals adds none.
    once = forwards("none")
    assert once > 0 and forwards("offload") > once and forwards("offload+attn") <= once


# Every named residual to pinned host: what a selective policy offloading all of them asks of XLA.
EVERY_NAME_TO_HOST = "offload=layer_input,attn_out,attn_lse,attn_qkv,mlp_input,mlp_gate_up"


def test_every_name_to_host_compiles_with_a_tiled_mlp():
    """Every named residual to host with the MLP in chunks (long rows beyond 8192 tokens) once asked XLA to copy
    the chunk loop's gate/up to the host, and XLA 0.11.2 failed its layout assignment ("INTERNAL: during context
    [end-of-post-layout_assignment]", 8B at 321536 tokens on the H200; the same at
    this small shape compiled for an H200 on a CPU). The tiled MLP's names are now kept by no policy
    (`jaxft.memory.policy.tiled_mlp_names`): it compiles, and the other residuals still go to the host."""
    compiled = _compiled(EVERY_NAME_TO_HOST, "scan", "pallas", small=True, mlp_chunk=256)
    assert _host_copies(compiled.as_text()) > 0


def test_every_name_to_host_compiles_with_the_device_side_attention_choice():
    """attention "auto" on rows with segment ids picks cuDNN (one document per row) or the flash kernel (packed)
    on the device, per batch. With every named residual to host, unrolled, XLA 0.11.2 rejected the
    conditional when each branch named its own residuals: one branch's went to host memory, the other's did not
    ("Expected instruction to have shape equal to ... S(5)", 8B packed 16k on the H200). The two kernels now
    share one residual slot named outside the cond (`api.dense_or_packed_pair`): it compiles, both kernels are
    in the program, and the residuals still go to the host."""
    compiled = _compiled(EVERY_NAME_TO_HOST, "unroll", "auto", small=True)
    text = compiled.as_text()
    assert _host_copies(text) > 0
    assert "jaxft_flash_fwd" in text and "__cudnn$fmha" in text


# Nested checkpointing (jaxft.memory.policy, `remat_block`): 4 layers of SMALL_CFG at 1 x 4096 (cuDNN dense: one
# document).
NESTED_CFG = ModelConfig(model_type="llama", vocab_size=2048, hidden_size=512, intermediate_size=2048, num_layers=4,
                         num_heads=8, num_kv_heads=2, head_dim=64)
NESTED_T = 4096


def _nested_program(remat: str, block: int | None):
    """(the jitted gradient step, its abstract arguments) of NESTED_CFG under `remat` with `remat_block` = block."""
    model = nnx.eval_shape(lambda: apply_lora(Decoder(NESTED_CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)),
                                              LoraConfig(r=16, alpha=32)))
    graphdef, lora, frozen = split_model(model)
    batch = {k: jax.ShapeDtypeStruct((1, 1, NESTED_T), jnp.float32 if k == "loss_mask" else jnp.int32)
             for k in ("input_ids", "targets", "loss_mask", "positions")}
    batch["segment_ids"] = None
    ex = ExecutionConfig(remat=remat, remat_block=block, layer_loop="scan")
    return jax.jit(lambda lo, fz, b: loss_and_grad_sums(graphdef, lo, fz, b, None, ex)[1]), (lora, frozen, batch)


@serial
def test_nested_offload_keeps_one_input_per_block_in_host_memory():
    """Blocks of 2 of 4 layers: the host holds 2 layer inputs where plain offload holds 4 (compiled host temp, each
    [1, T, H] bf16), and the device holds more than plain offload's (a block's second layer input while the block
    is differentiated) but less than no remat. Compiled for an H200 on a CPU (experiments/deviceless) the host temps
    were exactly 2 and 4 inputs."""
    def compiled(remat, block):
        fn, args = _nested_program(remat, block)
        return fn.lower(*args).compile(compiler_options=NO_AUTOTUNE).memory_analysis()

    one = NESTED_T * NESTED_CFG.hidden_size * 2
    plain, nested, none = compiled("offload", None), compiled("offload", 2), compiled("none", None)
    assert plain.host_temp_size_in_bytes == 4 * one and nested.host_temp_size_in_bytes == 2 * one
    assert plain.temp_size_in_bytes < nested.temp_size_in_bytes < none.temp_size_in_bytes
