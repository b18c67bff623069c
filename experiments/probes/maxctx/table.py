"""The rows experiments/probes/max_context.py derives instead of searching (auto's, from its candidates' rows;
Unsloth's, from a line through its measured peaks), the --unsloth-points parser, and the markdown table."""

from __future__ import annotations

from typing import Any

from experiments.probes.maxctx.probes import GIB, REMAT_OF

# Unsloth's measured peaks (tokens, GiB), 8B shape, batch 1, LoRA r16 all linear, H200 (issue #10's table).
UNSLOTH_POINTS = ((16384, 19.72), (32768, 23.9), (65536, 32.3))


def unsloth_derived(budget: int, points=UNSLOTH_POINTS) -> dict[str, float]:
    """Unsloth's longest row on `budget` bytes, DERIVED from a least-squares line through its measured peaks."""
    n = len(points)
    xs, ys = [p[0] / 1024 for p in points], [p[1] for p in points]
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    room = max(budget / GIB - intercept, 0.0)  # a budget below the intercept fits no row
    return dict(gib_per_1k_tokens=slope, intercept_gib=intercept, max_seq=int(room / slope) * 1024)


def auto_row(results: dict[str, dict]) -> dict[str, Any]:
    """auto's longest row, derived from the searched rows: auto takes the first of `AUTO_ORDER` whose compiled step
    fits the device and whose offloaded residuals fit the host (`jaxft.memory.choice.host_fit`), and where offload's
    layer inputs exceed the host it runs offload in nested blocks (`remat_block: auto`, the `offload_nested` row).
    So offload reaches the longer of its two rows, every other candidate its own, auto's longest row is the longest
    of these, and the row names the first candidate that reaches it (the one auto would choose there). The order is
    `AUTO_ORDER` itself: one document of tens of thousands of tokens attends enough for LEAN_ATTN's copies to pay
    (`jaxft.memory.policy.attention_copies_pay`; auto moves it after offload on rows that attend little)."""
    from jaxft.memory.policy import AUTO_ORDER

    row_of = {remat: name for name, (remat, extra) in REMAT_OF.items() if not extra}  # LEAN_ATTN: "lean_attn"
    reach: dict[str, tuple[str, dict]] = {}  # candidate -> (the form auto runs it in, its searched row)
    for p in AUTO_ORDER:
        name = row_of.get(p, p)
        forms = [(name, results[name])] if results.get(name, {}).get("max_seq") else []
        if p == "offload" and results.get("offload_nested", {}).get("max_seq"):
            forms.append(("offload in nested blocks", results["offload_nested"]))
        if forms:
            reach[p] = max(forms, key=lambda f: f[1]["max_seq"])
    if not reach:
        return dict(policy="auto", max_seq=None, note="no candidate searched or none fits")
    seq = max(r["max_seq"] for _, r in reach.values())
    choice, row = next(reach[p] for p in AUTO_ORDER if p in reach and reach[p][1]["max_seq"] >= seq)
    note = f"derived: the longest of {', '.join(f for f, _ in reach.values())}; auto would choose {choice}"
    return dict(policy="auto", max_seq=seq, choice=choice, note=note,
                device_bytes=row.get("device_bytes"), host_bytes=row.get("host_bytes"))


def parse_points(text: str | None) -> tuple[tuple[int, float], ...]:
    """'TOKENS:GIB,...' (at least two lengths) -> ((tokens, GiB), ...); None: `UNSLOTH_POINTS`."""
    if not text:
        return UNSLOTH_POINTS
    try:
        points = tuple((int(t), float(g)) for t, g in (item.split(":") for item in text.split(",") if item.strip()))
    except ValueError:
        raise SystemExit(f"--unsloth-points {text!r}: write TOKENS:GIB pairs, e.g. 4096:6.92,16384:9.8") from None
    if len({t for t, _ in points}) < 2:
        raise SystemExit(f"--unsloth-points {text!r}: a line needs peaks at two lengths at least")
    return points


def markdown(results: dict[str, dict], step: dict | None, budget: int | None, host_budget: int,
             unsloth_points=UNSLOTH_POINTS) -> str:
    gib = lambda b: "-" if b is None else f"{b / GIB:.2f}"  # noqa: E731
    lines = [f"Device budget {gib(budget)} GiB, host budget {gib(host_budget)} GiB "
             "(compiled memory analysis; `experiments/probes/max_context.py`).", "",
             "| policy | max T (tokens) | exact? | limited by | device GiB | host GiB | compile s | probes |",
             "|---|---:|---|---|---:|---:|---:|---:|"]
    for p, r in results.items():
        exact = "yes" if r.get("exact") else f"no ({r.get('stopped')}, first failing {r.get('first_failing')})"
        if r.get("error"):
            exact = f"error: {r['error'][:80]}"
        lines.append(f"| {p} | {r.get('max_seq') or '-'} | {exact} | {r.get('limited_by') or '-'} | "
                     f"{gib(r.get('device_bytes'))} | {gib(r.get('host_bytes'))} | {r.get('compile_s') or '-'} | "
                     f"{r.get('probes', '-')} |")
    auto = auto_row(results)
    lines.append(f"| auto (derived) | {auto.get('max_seq') or '-'} | {auto.get('note')} | | "
                 f"{gib(auto.get('device_bytes'))} | {gib(auto.get('host_bytes'))} | | |")
    if budget:
        u = unsloth_derived(budget, unsloth_points)
        at = "/".join(f"{t // 1024}k" for t, _ in unsloth_points)
        lines.append(f"| Unsloth (DERIVED, not measured: {u['gib_per_1k_tokens']:.3f} GiB per 1k tokens + "
                     f"{u['intercept_gib']:.2f} GiB, fit to its measured {at} peaks) | {u['max_seq']} | "
                     "derived | device (extrapolated) | | | | |")
    if step:
        lines += ["", f"Real step: {step.get('policy')} at {step.get('seq')} tokens: "
                  + (f"{step['step_s']} s ({step['tokens_per_s']} tokens/s), loss {step['loss']:.4f}, allocator "
                     f"peak {gib(step.get('peak_bytes'))} GiB (estimate {gib(step.get('estimate_bytes'))}), host "
                     f"peak RSS {gib(step.get('host_peak_rss_bytes'))} GiB, compile {step.get('compile_s')} s"
                     if step.get("ok") else f"FAILED: {step.get('error')}")]
    return "\n".join(lines) + "\n"


def from_probes(policy: str, probes: list[dict], stopped: str) -> dict[str, Any]:
    """A policy's result from the probes a worker reported before it was stopped (not exact)."""
    fits = [p for p in probes if p.get("fits")]
    fails = [p for p in probes if p.get("fits") is False]
    best = max(fits, key=lambda p: p["seq"]) if fits else None
    return dict(event="result", policy=policy, max_seq=best and best["seq"], exact=False, stopped=stopped,
                first_failing=min((p["seq"] for p in fails), default=None), probes=len(probes),
                device_bytes=best and best["device_bytes"], host_bytes=best and best["host_bytes"],
                compile_s=best and best["compile_s"], limited_by=None, error=None)

