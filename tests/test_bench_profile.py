"""The step-profile summary: device events joined with HLO op names and bucketed by jaxft's named scopes."""

from __future__ import annotations

import pytest

from scripts.bench.profile import classify, op_names_from_hlo, summarize_trace

HLO = """
HloModule jit_step
ENTRY %main {
  %gemm_fusion.1 = bf16[8,8] fusion(%a, %b), kind=kCustom, metadata={op_name="jit(step)/layers/mlp/dot_general"}
  %fusion.2 = bf16[8,8] fusion(%c), kind=kLoop, metadata={op_name="jit(step)/transpose(jvp(layers))/attention/exp"}
  %fusion.3 = f32[8] fusion(%d), kind=kLoop, metadata={op_name="jit(step)/cross_entropy/reduce_max"}
  %fusion.4 = f32[8] fusion(%e), kind=kLoop, metadata={op_name="jit(step)/optimizer/mul"}
  %fusion.5 = bf16[8,8] fusion(%f), kind=kLoop, metadata={op_name="jit(step)/layers/rmsnorm/rsqrt"}
  ROOT %fusion.6 = bf16[8,8] fusion(%g), kind=kLoop, metadata={op_name="jit(step)/layers/add"}
}
"""


def _trace():
    def ev(name, hlo_op, ts, dur, pid=7):
        return {"ph": "X", "pid": pid, "tid": 1, "name": name, "ts": ts, "dur": dur, "args": {"hlo_op": hlo_op}}

    return {"traceEvents": [
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        ev("nvjet_hsh_128x256_gemm", "gemm_fusion.1", 0, 600),
        ev("loop_exp_fusion", "fusion.2", 600, 200),
        ev("loop_reduce_fusion", "fusion.3", 800, 100),
        ev("loop_mul_fusion", "fusion.4", 900, 50),
        ev("loop_rsqrt_fusion", "fusion.5", 950, 25),
        ev("loop_add_fusion", "fusion.6", 975, 25),
        ev("host_thing", "fusion.6", 0, 99999, pid=1),  # host events are not device time
    ]}


def test_hlo_op_names_are_parsed():
    names, opcodes = op_names_from_hlo(HLO)
    assert names["fusion.3"] == "jit(step)/cross_entropy/reduce_max"
    assert opcodes["gemm_fusion.1"] == "fusion" and "fusion.6" in names


@pytest.mark.parametrize("kernel,hlo_op,op_name,want", [
    ("sm90_xmma_gemm_bf16", "custom-call.3", "jit(step)/layers/attn/q_proj/dot_general", "matmul"),
    ("cudnn_generated_fort_native_sdpa", "custom-call.9", "", "attention"),
    ("jaxft_flash_fwd", "custom-call.11", "", "attention"),
    ("loop_fusion", "fusion.8", "jit(step)/layers/lora/dot_general", "lora"),
    ("MemcpyD2H", "copy-start.1", "", "memcpy"),
    ("loop_fusion", "fusion.9", "jit(step)/layers/glu/logistic", "norm_rope_glu"),
    ("mosaic_gpu_kernel", "custom-call.4", "jit(step)/layers/mlp/moe_experts/pallas_call", "moe_experts"),
    ("mosaic_gpu_kernel", "custom-call.5", "jit(step)/layers/mlp/moe_experts/expert_lora/pallas_call",
     "expert_lora"),
    ("input_reduce_fusion", "fusion.12", "jit(step)/layers/mlp/moe_router/top_k", "moe_router"),
])
def test_classify(kernel, hlo_op, op_name, want):
    assert classify(kernel, hlo_op, op_name, "fusion") == want


def test_summary_buckets_device_time_and_idle():
    out = summarize_trace(_trace(), HLO, steps=1, wall_s=0.0012)
    ms = out["kernel_ms_per_step"]
    assert ms == pytest.approx({"matmul": 0.6, "attention": 0.2, "cross_entropy": 0.1, "optimizer": 0.05,
                                "norm_rope_glu": 0.025, "other": 0.025})
    assert out["device_busy_ms_per_step"] == pytest.approx(1.0)
    assert out["idle_or_host_ms_per_step"] == pytest.approx(0.2)
    assert sum(out["kernel_share"].values()) == pytest.approx(1.0)


def test_overlap_summary_measures_hidden_and_serialised_copies():
    from scripts.bench.profile import overlap_summary

    hlo = ('  %copy-start.1 = (bf16[8], bf16[8]) copy-start(%a), metadata={op_name="jit(step)/layers/x"}\n'
           '  %fusion.2 = bf16[8] fusion(%c), kind=kLoop, metadata={op_name="jit(step)/transpose(jvp(layers))/mul"}\n'
           '  %fusion.3 = bf16[8] fusion(%c), kind=kLoop, metadata={op_name="jit(step)/layers/mul"}\n')

    def ev(name, hlo_op, ts, dur):
        return {"ph": "X", "pid": 7, "tid": 1, "name": name, "ts": ts, "dur": dur, "args": {"hlo_op": hlo_op}}

    meta = {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}}
    # Forward 0-1000 us, backward 1000-3000 us; a 500 us copy inside the backward and a 500 us one after it.
    trace = {"traceEvents": [meta, ev("loop_fusion", "fusion.3", 0, 1000), ev("loop_fusion", "fusion.2", 1000, 2000),
                             ev("MemcpyDtoH", "copy-start.1", 1500, 500), ev("MemcpyHtoD", "", 3000, 500)]}
    out = overlap_summary(trace, hlo, steps=1, num_layers=2)
    assert out["host_copy_ms_per_step"] == 1.0 and out["compute_ms_per_step"] == 3.0
    assert out["backward_compute_ms_per_step"] == 2.0 and out["backward_ms_per_layer"] == 1.0
    assert out["copy_overlapped_ms_per_step"] == 0.5 and out["copy_hidden_fraction"] == 0.5
    assert (out["serialised_bound_ms"], out["overlapped_bound_ms"], out["busy_ms_per_step"]) == (4.0, 3.0, 3.5)
