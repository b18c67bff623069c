"""Where a jaxft training step spends its time: a JAX profiler trace joined with XLA's optimized HLO.

The trace's device events name the HLO instruction they ran (`args.hlo_op`); the HLO dump gives each
instruction's `op_name` (the JAX name stack, which carries jaxft's named scopes: attention, rope,
rmsnorm, glu, lora, cross_entropy, optimizer). Each device event is put in one category:

    expert_lora    scope "expert_lora" (MoE expert LoRA: its grouped matmuls and their backward)
    moe_router     scope "moe_router" (router logits, top-k, softmax)
    moe_experts    scope "moe_experts" (sort, gather, the experts' grouped matmuls, scatter; backward too)
    attention      scope "attention", cuDNN fused attention custom calls, jaxft's Pallas kernels
    cross_entropy  scope "cross_entropy" (the chunked linear cross-entropy, its matmuls included)
    optimizer      scope "optimizer"
    lora           scope "lora" (the rank-r adapter matmuls and their backward)
    matmul         every other GEMM (kernel names: gemm / nvjet / cutlass / cublas / xmma; or a dot HLO)
    norm_rope_glu  scopes rmsnorm, rope, glu
    memcpy         host <-> device copies (rematerialisation offload) and device copies
    other          the rest (residual adds, casts, loop bookkeeping, ...)

Idle time = wall time of the profiled steps minus the union of device busy intervals.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
from collections import defaultdict
from typing import Any

# First match wins: the MoE scopes come first (expert_lora sits inside moe_experts; neither is a "/lora" scope).
SCOPES = ("expert_lora", "moe_router", "moe_experts", "attention", "cross_entropy", "optimizer", "lora")
ELEMENTWISE_SCOPES = ("rmsnorm", "rope", "glu")
GEMM_KERNEL = re.compile(r"gemm|nvjet|cutlass|cublas|xmma|matmul", re.I)
ATTENTION_KERNEL = re.compile(r"cudnn|fmha|sdpa|jaxft_flash", re.I)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name=\"([^\"]*)\"")
_CALLS = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\S+\s+(\w[\w\-]*)\(")


def op_names_from_hlo(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """(instruction -> op_name, instruction -> HLO opcode) from an optimized HLO module's text."""
    names, opcodes = {}, {}
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m:
            names[m.group(1)] = m.group(2)
        c = _CALLS.match(line)
        if c:
            opcodes[c.group(1)] = c.group(2)
    return names, opcodes


def classify(kernel: str, hlo_op: str, op_name: str, opcode: str) -> str:
    scope = op_name.lower()
    if "memcpy" in kernel.lower() or opcode in ("copy-start", "copy-done"):
        return "memcpy"
    for name in SCOPES:
        if f"/{name}" in scope or scope.startswith(name):
            return name
    if ATTENTION_KERNEL.search(kernel) or ATTENTION_KERNEL.search(hlo_op):
        return "attention"
    if GEMM_KERNEL.search(kernel) or opcode in ("dot", "custom-call") and "gemm" in hlo_op.lower():
        return "matmul"
    if "dot" in hlo_op.lower() and opcode in ("fusion", "dot"):
        return "matmul"
    if any(f"/{name}" in scope for name in ELEMENTWISE_SCOPES):
        return "norm_rope_glu"
    return "other"


def scope_key(op_name: str) -> str:
    """The JAX name stack of an HLO op without jit/transpose wrappers and array indices, so the same
    source op in every layer (and its forward, backward and recompute) adds up under one key."""
    parts = [p for p in op_name.split("/") if p and not p.startswith(("jit(", "jvp(", "pjit", "while", "body",
                                                                      "checkpoint", "remat"))]
    return "/".join(parts[-4:]) or "(no op_name)"


def _device_pids(events: list[dict[str, Any]]) -> set[int]:
    pids = set()
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            label = str(e.get("args", {}).get("name", ""))
            if "/device:GPU" in label or "/device:gpu" in label.lower():
                pids.add(e["pid"])
    return pids


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize_trace(trace: dict[str, Any], hlo_text: str, steps: int, wall_s: float) -> dict[str, Any]:
    """Category -> milliseconds per step (and shares of the step's wall time)."""
    events = trace.get("traceEvents", [])
    pids = _device_pids(events)
    names, opcodes = op_names_from_hlo(hlo_text)
    per_cat: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    by_scope: dict[str, float] = defaultdict(float)
    busy = []
    for e in events:
        if e.get("ph") != "X" or (pids and e.get("pid") not in pids):
            continue
        args = e.get("args", {})
        hlo_op = str(args.get("hlo_op", ""))
        kernel = str(e.get("name", ""))
        if not hlo_op and "memcpy" not in kernel.lower():
            continue
        dur_us = float(e.get("dur", 0.0))
        cat = classify(kernel, hlo_op, names.get(hlo_op, ""), opcodes.get(hlo_op, ""))
        per_cat[cat] += dur_us
        top[f"{cat}: {hlo_op or kernel}"] += dur_us
        by_scope[f"{cat}: {scope_key(names.get(hlo_op, ''))}"] += dur_us
        busy.append((float(e["ts"]), float(e["ts"]) + dur_us))
    busy_us = _union_length(busy)
    wall_us = wall_s * 1e6
    out = {
        "steps": steps,
        "step_ms": wall_us / steps / 1e3,
        "device_busy_ms_per_step": busy_us / steps / 1e3,
        "idle_or_host_ms_per_step": max(wall_us - busy_us, 0.0) / steps / 1e3,
        "kernel_ms_per_step": {k: v / steps / 1e3 for k, v in sorted(per_cat.items(), key=lambda kv: -kv[1])},
        "top_ops_ms_per_step": {k: v / steps / 1e3 for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:40]},
        "top_scopes_ms_per_step": {k: v / steps / 1e3 for k, v in sorted(by_scope.items(), key=lambda kv: -kv[1])[:40]},
        "note": "kernel times summed over streams (overlapping copies count in full); shares are of device busy "
                "time; idle = step wall time minus the union of device busy intervals",
    }
    total = sum(per_cat.values()) or 1.0
    out["kernel_share"] = {k: per_cat[k] / total for k in out["kernel_ms_per_step"]}
    return out


def load_trace(log_dir: str) -> dict[str, Any]:
    paths = [p for p in glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz"))
             if not p.endswith("perfetto_trace.json.gz")]
    if not paths:
        raise FileNotFoundError(f"no *.trace.json.gz under {log_dir}/plugins/profile")
    with gzip.open(max(paths, key=os.path.getmtime), "rb") as f:
        return json.load(f)


def load_step_hlo(dump_dir: str, module_hint: str = "step") -> str:
    """The optimized HLO text of the largest dumped module whose name contains `module_hint`."""
    paths = [p for p in glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")) if module_hint in p]
    if not paths:
        return ""
    with open(max(paths, key=os.path.getsize)) as f:
        return f.read()


def _intersection_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of (union of a) intersected with (union of b)."""
    return _union_length(a) + _union_length(b) - _union_length(a + b)


def _host_copy(kernel: str, opcode: str) -> bool:
    k = kernel.lower()
    return ("memcpy" in k and ("dtoh" in k or "htod" in k or "d2h" in k or "h2d" in k)) or opcode in (
        "copy-start", "copy-done")


def overlap_summary(trace: dict[str, Any], hlo_text: str, steps: int, num_layers: int) -> dict[str, Any]:
    """Host offload vs compute in a profiled step (ms per step): the host<->device copy time c, the compute
    time g (union of non-copy device kernels), the backward's compute (ops under JAX's `transpose(` name stack)
    and its per-layer share, and how much of c ran while compute ran. Overlapped copies cost max(c, g),
    serialised ones c + g: `copy_hidden_fraction` = overlap / c (1.0 = fully hidden, 0.0 = serialised)."""
    events = trace.get("traceEvents", [])
    pids = _device_pids(events)
    names, opcodes = op_names_from_hlo(hlo_text)
    copies, compute, backward = [], [], []
    for e in events:
        if e.get("ph") != "X" or (pids and e.get("pid") not in pids):
            continue
        kernel = str(e.get("name", ""))
        hlo_op = str(e.get("args", {}).get("hlo_op", ""))
        span = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        if _host_copy(kernel, opcodes.get(hlo_op, "")):
            copies.append(span)
        elif hlo_op:
            compute.append(span)
            if "transpose(" in names.get(hlo_op, ""):
                backward.append(span)
    c, g = _union_length(copies), _union_length(compute)
    overlap = _intersection_length(copies, compute)
    per = 1e3 * steps
    return {
        "host_copy_ms_per_step": c / per,
        "compute_ms_per_step": g / per,
        "backward_compute_ms_per_step": _union_length(backward) / per,
        "backward_ms_per_layer": _union_length(backward) / per / max(num_layers, 1),
        "copy_overlapped_ms_per_step": overlap / per,
        "copy_hidden_fraction": overlap / c if c else None,
        "serialised_bound_ms": (c + g) / per,
        "overlapped_bound_ms": max(c, g) / per,
        "busy_ms_per_step": _union_length(copies + compute) / per,
        "host_copy_events": len(copies),
    }
