"""The async copies of a compiled XLA GPU program that touch pinned host memory, and the GEMMs scheduled under each:
read from `compiled.as_text()` (a scheduled HLO module). Plain text parsing, no JAX or CUDA plugin: the GPU tests
(tests/test_frozen_weights_gpu.py) and the lab's deviceless compiles (experiments/deviceless/) read programs with it."""

from __future__ import annotations

import re


def schedules(text: str) -> list[tuple[str, list[tuple[str, int]]]]:
    """(while body, [(async copy touching host memory, GEMMs between its start and done)]) per body with one."""
    out = []
    for m in re.finditer(r"\n(%[\w.]+) \(.*?\n}", text, re.S):
        lines = [ln.strip() for ln in m.group(0).splitlines()]
        if not any("S(5)" in ln for ln in lines):
            continue
        ops = []
        for ln in lines:
            mm = re.match(r"(?:ROOT )?(%[\w.-]+) = .*? ([\w-]+)\((.*)", ln)
            if mm:
                ops.append((mm.group(1), mm.group(2), mm.group(3), ln))
        copies = []
        for i, (name, op, _, ln) in enumerate(ops):
            if op == "fusion-start" and "S(5)" in ln:
                done = next(j for j, o in enumerate(ops) if o[1] == "fusion-done" and name + ")" in o[2])
                copies.append((name, sum(1 for o in ops[i:done] if "gemm" in o[0])))
        if copies:
            out.append((m.group(1), copies))
    return out


def gemms_under_fetches(text: str) -> list[int]:
    """GEMMs between each fetch from host memory (an asynchronous dynamic slice of a host buffer) and its done, in
    every computation of `text` that has one (`schedules`): 0 is a fetch waited for before any compute."""
    return [n for _, copies in schedules(text) for name, n in copies if "dynamic-slice" in name]


def host_slice_forms(text: str) -> list[tuple[str, str, bool]]:
    """Every dynamic slice (or dynamic update slice) in `text` that reads (writes) a pinned host buffer: (its
    name, "slice" / "update", whether XLA made it a memcpy). XLA's GPU backend gives a dynamic (update) slice whose
    offsets follow the loop counter a `dynamic_slice_config` backend config and runs it as a copy (a DMA, no
    kernel); one without is a loop fusion, a kernel whose threads read or write the host memory over PCIe on the
    SMs the layer's matmuls want."""
    out = []
    for ln in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?(%[\w.-]+) = \S+ (dynamic-slice|dynamic-update-slice)\((%[\w.-]+)", ln)
        if not m:
            continue
        operand = re.search(re.escape(m.group(3)) + r" = (\S+)", text)
        host = "S(5)" in ln.split(" = ", 1)[1].split(" ", 1)[0] or bool(operand and "S(5)" in operand.group(1))
        if host:
            out.append((m.group(1), "slice" if m.group(2) == "dynamic-slice" else "update",
                        "dynamic_slice_config" in ln))
    return out


def host_slice_counts(text: str) -> tuple[int, int]:
    """(copies, kernels) among the dynamic (update) slices of pinned host buffers in `text` (`host_slice_forms`)."""
    forms = host_slice_forms(text)
    copies = sum(memcpy for *_, memcpy in forms)
    return copies, len(forms) - copies
