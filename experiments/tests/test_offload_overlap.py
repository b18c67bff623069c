"""experiments/probes/offload_overlap.py's trace reader on a synthetic GPU trace whose copy/compute overlap is known:
only stream lines count (the derived lines repeat the spans), only events inside a step's annotation, copies by
direction, backward kernels by the HLO op's name stack, copies on their own stream or not."""

from __future__ import annotations

import pytest

from experiments.probes import offload_overlap as ov

HLO = """
ENTRY %main {
  %fusion.1 = bf16[8,8]{1,0} fusion(%p), kind=kLoop, calls=%f1, metadata={op_name="jit(step)/jvp(layer)/dot_general"}
  %fusion.2 = bf16[8,8]{1,0} fusion(%p), kind=kLoop, calls=%f2, metadata={op_name="jit(step)/transpose(jvp(layer))/dot_general"}
  %fusion.4 = bf16[8,8]{1,0} fusion(%p), kind=kLoop, calls=%f4, metadata={op_name="jit(step)/transpose(jvp(cross_entropy))/dot_general"}
  ROOT %fusion.3 = bf16[8,8]{1,0} fusion(%p), kind=kLoop, calls=%f3, metadata={op_name="jit(step)/transpose(jvp(layer))/mul"}
}
"""


def _meta(pid, name, tid=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _x(pid, tid, ts, dur, name, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}


def trace(steps=(0, 1)):
    ev = [_meta(1, "/host:CPU"), _meta(1, "python", 1), _meta(2, "/device:GPU:0"),
          _meta(2, "Stream #7(Compute)", 7), _meta(2, "Stream #20(MemcpyD2H)", 20), _meta(2, "Stream #21(MemcpyH2D)", 21),
          _meta(2, "XLA Ops", 99),
          # outside every step: not counted
          _x(2, 7, 1500, 100, "gemm_kernel", hlo_op="fusion.2")]
    if 0 in steps:  # copies on their own streams, 150 of their 200 us under compute
        ev += [_x(1, 1, 0, 1000, "overlap_step_0"),
               _x(2, 7, 100, 200, "loop_fusion", hlo_op="fusion.1"),           # forward
               _x(2, 7, 400, 300, "gemm_kernel", hlo_op="fusion.2"),           # backward
               _x(2, 7, 700, 200, "loop_fusion", hlo_op="fusion.3"),           # backward
               _x(2, 7, 900, 40, "gemm_kernel", hlo_op="fusion.4"),            # the loss's backward: not a layer's
               _x(2, 20, 200, 150, "MemcpyD2H", memcpy_details="size:4096"),  # 100 hidden
               _x(2, 21, 600, 50, "MemcpyH2D"),                               # 50 hidden
               _x(2, 7, 950, 10, "MemcpyD2D"),                                 # device copy: neither
               _x(2, 99, 100, 800, "fusion.2", hlo_op="fusion.2")]            # derived line: ignored
    if 1 in steps:  # a copy queued on the compute stream before the kernels: serialised
        ev += [_x(1, 1, 2000, 1000, "overlap_step_1"),
               _x(2, 7, 2000, 100, "MemcpyD2H"),
               _x(2, 7, 2100, 400, "gemm_kernel", hlo_op="fusion.2")]
    return {"traceEvents": ev}


def test_overlap_of_copies_on_their_own_streams():
    r = ov.analyse_trace(trace(steps=(0,)), HLO, num_layers=2)
    assert r["steps"] == 1
    assert (r["d2h_ms"], r["h2d_ms"], r["copy_ms"], r["d2d_ms"]) == (0.15, 0.05, 0.2, 0.01)
    assert (r["compute_ms"], r["backward_ms"], r["backward_per_layer_ms"]) == (0.74, 0.5, 0.25)
    assert (r["overlap_ms"], r["sum_ms"], r["union_ms"], r["max_ms"]) == (0.15, 0.94, 0.79, 0.74)
    assert r["hidden_fraction"] == 0.75 and r["copies_on_own_streams"] == 1.0 and r["separate_copy_streams"]
    assert r["copy_events_per_step"] == 2 and r["copy_bytes_per_step"] == 4096
    assert r["copy_streams"] == ["Stream #20(MemcpyD2H)", "Stream #21(MemcpyH2D)"]


def test_a_copy_on_the_compute_stream_is_serialised_and_steps_average():
    r = ov.analyse_trace(trace(), HLO, num_layers=2)
    assert r["steps"] == 2
    assert (r["d2h_ms"], r["copy_ms"], r["compute_ms"], r["backward_ms"]) == (0.125, 0.15, 0.57, 0.45)
    assert r["overlap_ms"] == 0.075 and r["hidden_fraction"] == 0.5
    assert r["copies_on_own_streams"] == 0.5 and not r["separate_copy_streams"]


def test_a_cpu_trace_says_it_has_no_device_streams():
    cpu = {"traceEvents": [_meta(1, "/host:CPU"), _x(1, 1, 0, 10, "overlap_step_0")]}
    r = ov.analyse_trace(cpu, HLO, num_layers=2)
    assert "no GPU stream events" in r["note"] and "copy_ms" not in r


def test_the_trimmed_trace_keeps_the_last_step_of_the_streams():
    kept = ov.trim_trace(trace(), label="offload", pid_offset=1000)
    spans = [(e["ts"], e["tid"]) for e in kept if e["ph"] == "X"]
    assert sorted(spans) == [(2000, 7), (2100, 7)]
    assert all(e["pid"] == 1002 for e in kept)
    assert any(e.get("name") == "process_name" and e["args"]["name"] == "offload /device:GPU:0" for e in kept)


def test_variants_are_validated_in_one_line():
    assert ov.parse_variant("offload:explicit:unroll") == dict(policy="offload", transfer="explicit", loop="unroll",
                                                               weights="device")
    assert ov.parse_variant("full:policy:scan:host")["weights"] == "host"
    with pytest.raises(SystemExit, match="POLICY:TRANSFER:LOOP"):
        ov.parse_variant("offload:unroll")
