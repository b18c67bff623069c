"""Derived statistics and the markdown table of the training benchmark.

All systems' raw measurements go through ``summarise_run``, so the statistics are computed
identically: the first ``warmup`` steps are dropped, the step time is the median of the rest,
tokens/s = tokens per step / median step time, MFU = mean useful FLOPs per timed step / median
step time / the bf16 matmul ceiling (the maximum of the torch and JAX measurements of the same
run, so every system is divided by the same number). A peak memory that is the JAX worker's
static estimate rather than an allocator measurement is marked with STATIC_MARK in the table.
When the systems ran concurrently on several GPUs (meta concurrent_gpus > 1), the table gains a
last column, the GPU index each run ran on.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import statistics
import subprocess
from typing import Any

from .workloads import FLOP_FORMULA, Workload

GIB = 1024 ** 3
STATIC_MARK = "*"


def heading(script: str, argv: list[str], *details: str) -> str:
    """The first line of a committed table: today's date, the short commit of this checkout, any `details` (the
    device, say) and the exact command, `python <script> <argv>`."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    return ", ".join([str(dt.date.today()), f"commit `{commit}`", *details, f"`{' '.join(['python', script, *argv])}`"])


def summarise_run(raw: dict[str, Any], workload: Workload, warmup: int,
                  flops_per_step: list[float], expected_sha: str, expected_trainable: int | None,
                  ceiling_flops_per_s: float | None) -> dict[str, Any]:
    """Statistics of one (system, workload) run; ``raw`` is the worker's result dict; ``expected_trainable``: the
    LoRA parameter count (a full fine-tune: the model's; None: not checked)."""
    out: dict[str, Any] = {"status": raw.get("status", "error")}
    if out["status"] != "ok":
        return out
    times = [float(t) for t in raw["step_times_s"]][warmup:]
    losses = [float(x) for x in raw["losses"]]
    med = statistics.median(times)
    flops = statistics.fmean(flops_per_step[warmup:])
    out.update({
        "timed_steps": len(times),
        "median_step_s": med,
        "min_step_s": min(times),
        "max_step_s": max(times),
        "tokens_per_s": workload.tokens_per_step / med,
        "peak_memory_bytes": int(raw["peak_memory_bytes"]),
        "peak_memory_gib": raw["peak_memory_bytes"] / GIB,
        # Results written before sessions existed carry no source: they were allocator peaks.
        "peak_memory_source": raw.get("peak_memory_source", "allocator"),
        "useful_flops_per_step": flops,
        "achieved_flops_per_s": flops / med,
        "mfu": (flops / med / ceiling_flops_per_s) if ceiling_flops_per_s else None,
        "first_loss": losses[0],
        # DPO: step 0's mean log-probability of the chosen completions (the loss there is ln 2 in every system)
        **({"first_logps_chosen": raw["extra"]["objective_metrics"][0]["logps/chosen"]}
           if workload.dpo and raw.get("extra", {}).get("objective_metrics") else {}),
        "final_loss": losses[-1],
        "loss_finite": all(math.isfinite(x) for x in losses),
        "data_matches": raw.get("data_sha256") == expected_sha,
        "lora_params_match": expected_trainable is None or raw.get("trainable_params") in (None, expected_trainable),
    })
    return out


def first_loss_spread(runs: list[dict[str, Any]], workload: str, key: str = "first_loss") -> float | None:
    """Relative spread of the step-0 loss across systems (same weights, same data, LoRA B = 0
    at init, so every system should compute the same first loss up to bf16 rounding); `key`
    first_logps_chosen: of a DPO row's step-0 chosen log-probability (its loss is ln 2 whatever the data)."""
    vals = [r["summary"][key] for r in runs
            if r["workload"] == workload and r["summary"].get("status") == "ok" and key in r["summary"]]
    if len(vals) < 2:
        return None
    return (max(vals) - min(vals)) / max(abs(statistics.fmean(vals)), 1e-12)


# Systems whose remat is `auto` (examples/bench/auto*.yaml), and the jaxft systems that are not a policy of the
# same step (a 4-bit base trains another model).
AUTO_SYSTEMS = ("jaxft_auto", "jaxft_auto_40gb")
NOT_A_POLICY = ("jaxft_qlora", "jaxft_qlora_lean", "jaxft_qlora_offload")
AUTO_TOLERANCE = 0.05  # issue #10: auto within 5% of the best policy that fits


def auto_check(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload and auto system that ran ok: the fastest other jaxft policy of the same run that fits auto's
    budget (its peak within the recipe's `max_memory_gb`; with none set, every policy that ran on the device fits)
    and whether auto's tokens/s is within AUTO_TOLERANCE of it. Runs of auto's own choice count as candidates too:
    what auto picked, run under its own name, is the bar it must meet."""
    out = []
    for auto in runs:
        s = auto["summary"]
        if auto["system"] not in AUTO_SYSTEMS or s.get("status") != "ok":
            continue
        settings = auto["raw"].get("settings", {})
        budget = settings.get("max_memory_gb")
        fitting = [r for r in runs if r["workload"] == auto["workload"] and r["system"].startswith("jaxft")
                   and r["system"] not in AUTO_SYSTEMS + NOT_A_POLICY and r["summary"].get("status") == "ok"
                   and (budget is None or r["summary"]["peak_memory_gib"] <= budget)]
        best = max(fitting, key=lambda r: r["summary"]["tokens_per_s"], default=None)
        row = {"workload": auto["workload"], "system": auto["system"], "budget_gib": budget,
               "choice": settings.get("remat"), "remat_layers": settings.get("remat_layers"),
               "remat_block": settings.get("remat_block"), "tokens_per_s": s["tokens_per_s"],
               "best_system": best and best["system"], "best_tokens_per_s": best and best["summary"]["tokens_per_s"]}
        row["ratio"] = best and s["tokens_per_s"] / best["summary"]["tokens_per_s"]
        row["within"] = None if best is None else row["ratio"] >= 1 - AUTO_TOLERANCE
        out.append(row)
    return out


def _auto_lines(checks: list[dict[str, Any]]) -> list[str]:
    if not checks:
        return []
    lines = ["", f"## remat auto against the fastest policy that fits its budget (bar: within "
             f"{100 * AUTO_TOLERANCE:.0f}%)", "",
             "| workload | auto system | budget (GiB) | chose | tokens/s | fastest that fits | its tokens/s | ratio | "
             "within |", "|---|---|---:|---|---:|---|---:|---:|---|"]
    for c in checks:
        chose = c["choice"] + (f" on {c['remat_layers']} layers" if c["remat_layers"] is not None else "") + \
            (f", blocks {c['remat_block']}" if c["remat_block"] is not None else "")
        best = "-" if c["best_system"] is None else c["best_system"]
        lines.append(f"| {c['workload']} | {c['system']} | {'device' if c['budget_gib'] is None else c['budget_gib']}"
                     f" | {chose} | {c['tokens_per_s']:,.0f} | {best} | "
                     + ("- | - | no other policy ran |" if c["best_system"] is None else
                        f"{c['best_tokens_per_s']:,.0f} | {c['ratio']:.3f} | {'yes' if c['within'] else 'NO'} |"))
    return lines


def _si(x: float) -> str:
    """3 significant digits with an SI prefix: 7.5e9 -> '7.50 G'."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}"
    return f"{x:.3g} "


def _status_cell(run: dict[str, Any]) -> str:
    s = run["summary"]["status"]
    if s == "ok":
        flags = []
        if not run["summary"].get("data_matches", True):
            flags.append("DATA MISMATCH")
        if not run["summary"].get("lora_params_match", True):
            flags.append("LoRA param count differs")
        if not run["summary"].get("loss_finite", True):
            flags.append("non-finite loss")
        return "ok" + (f" ({'; '.join(flags)})" if flags else "")
    reason = run["raw"].get("error", "")
    return f"{s}" + (f": {reason[:120]}" if reason and s != "oom" else "")


def _row(run: dict[str, Any], gpu_column: bool) -> str:
    s = run["summary"]
    cells = [run["workload"], run["system"], _status_cell(run)]
    if s["status"] == "ok":
        mfu = s.get("mfu")
        mark = STATIC_MARK if s.get("peak_memory_source") == "static_estimate" else ""
        cells += [f"{s['median_step_s'] * 1e3:.1f}", f"{s['tokens_per_s']:,.0f}",
                  f"{s['peak_memory_gib']:.2f}{mark}", "-" if mfu is None else f"{100 * mfu:.1f}%",
                  f"{s['first_loss']:.4f} -> {s['final_loss']:.4f}"]
    else:
        cells += ["-"] * 5
    if gpu_column:
        cells.append("-" if run.get("gpu") is None else str(run["gpu"]))
    return "| " + " | ".join(cells) + " |"


def markdown(report: dict[str, Any]) -> str:
    meta, ceil = report["meta"], report["ceiling"]
    lines = ["# LoRA training benchmark", ""]
    lines += [f"- date: {meta['date']}", f"- commit: {meta['commit']}",
              f"- GPU / device: {meta['device_name']}",
              f"- command: `{meta['command']}`"]
    gpu_column = meta.get("concurrent_gpus", 1) > 1
    if gpu_column:
        lines.append(f"- {meta['concurrent_gpus']} GPUs, systems concurrently (one session per GPU): "
                     + "; ".join(meta.get("gpus", [])))
    for earlier in meta.get("resumed_commands", []):
        lines.append(f"- earlier pass (resumed, its runs kept): `{earlier}`")
    for side, vers in sorted(meta.get("versions", {}).items()):
        lines.append(f"- versions ({side}): " + ", ".join(f"{k} {v}" for k, v in sorted(vers.items())))
    used = ceil.get("used_flops_per_s")
    parts = [f"{fw} {_si(c['flops_per_s'])}FLOP/s" for fw, c in sorted(ceil.items())
             if isinstance(c, dict) and c.get("status") == "ok"]
    used_txt = "-" if used is None else f"{_si(used)}FLOP/s"
    lines.append(f"- bf16 matmul ceiling (square matmuls, best size): "
                 f"{', '.join(parts) or 'not measured'}; MFU divides by {used_txt} (the max)")
    lines.append(f"- steps: {meta['steps']} per run, first {meta['warmup']} excluded from timing "
                 f"(median of {meta['steps'] - meta['warmup']}); loss = loss of the last step")
    lora, adamw = meta["lora"], meta["adamw"]
    lines.append(f"- LoRA: r={lora['r']}, alpha={lora['alpha']}, dropout={lora['dropout']}, "
                 f"targets {','.join(lora['targets'])}"
                 + (f" (MoE: attention + experts {','.join(lora['expert_targets'])})" if lora.get("expert_targets")
                    and any(w.get("params", {}).get("lora_active", 0) != w.get("params", {}).get("lora", 0)
                            for w in report["workloads"].values()) else "")
                 + f"; AdamW lr={adamw['lr']}, "
                 f"betas=({adamw['b1']}, {adamw['b2']}), eps={adamw['eps']}, "
                 f"weight_decay={adamw['weight_decay']} on the LoRA parameters")
    lines.append(f"- FLOPs: {FLOP_FORMULA}")
    lines += ["", "| workload | system | status | step (ms) | tokens/s | peak mem (GiB) | MFU | "
              "loss first -> last |" + (" gpu |" if gpu_column else ""),
              "|---|---|---|---:|---:|---:|---:|---|" + ("---:|" if gpu_column else "")]
    for run in report["runs"]:
        lines.append(_row(run, gpu_column))
    if any(r["summary"].get("peak_memory_source") == "static_estimate" for r in report["runs"]):
        lines += ["", f"{STATIC_MARK} static estimate, not an allocator measurement: JAX cannot reset its "
                  "peak counter and an earlier task of the same process had set a higher peak, so this is "
                  "bytes in use before the first step + the compiled step's temp + output - aliased "
                  "(donated) bytes (XLA memory_analysis)."]
    lines += _auto_lines(auto_check(report["runs"]))
    lines += ["", "## Workloads", ""]
    for name, w in report["workloads"].items():
        d = w["data"]
        rows = (f"{w['batch']} DPO pair(s) x 2 sides x {w['seq_len']} (prompt {d.get('prompt_len')})" if w.get("dpo")
                else f"batch {w['batch']} x {w['seq_len']}{' packed' if w['packed'] else ''}")
        lines.append(f"- {name}: shape {w['shape']}, {rows}; frozen matmul params "
                     f"{_si(w['params']['frozen_matmul'])}, LoRA params {_si(w['params']['lora'])}; "
                     f"{d['documents'] / d['steps']:.1f} docs/step (mean {d['mean_doc_len']:.0f} "
                     f"tokens); useful {_si(w['useful_flops_per_step'])}FLOP/step"
                     + (f"; first-loss spread across systems {100 * w['first_loss_spread']:.2f}%"
                        if w.get("first_loss_spread") is not None else "")
                     + (f"; step-0 chosen log-probability spread {100 * w['first_logps_spread']:.3f}%"
                        if w.get("first_logps_spread") is not None else ""))
    notes = report.get("notes", [])
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
