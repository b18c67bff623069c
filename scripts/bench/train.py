#!/usr/bin/env python
"""LoRA training benchmark: jaxft vs HF transformers + PEFT vs Unsloth, one process per system.

Every system trains the same random-weight model directory (saved once per shape on the device
with save_pretrained), on the same token ids (workloads.make_token_data, checked by
SHA-256), with the same LoRA settings and AdamW, for the same number of steps.

Order of work: the matmul ceilings; one session saving every needed model directory (on /dev/shm
when it has room: tmpfs writes and reads are far faster than disk); then, in --systems order, one
worker session per system: a torch system runs all its workloads in one process (consecutive tasks
on one shape reuse the loaded base model), a JAX system one process per model shape, with the
shape's workloads in ascending expected memory (JAX cannot reset its peak counter, see
jaxft_worker.py). Within a session each task still starts from the same LoRA init, a fresh
optimizer and its own data. Results are saved after every task (JSON + markdown), so a run cut
short still leaves a valid partial table; a session that dies (timeout, crash) costs the task it
died in, and a new session runs the tasks after it (sessions.py). The run itself is
harness.py (Bench), the GPU discovery gpus.py; this module parses the arguments and starts the
report.

With --gpus N > 1 (one host), the ceilings and the model saves run first, alone, on the first
GPU; then the same queue of sessions runs up to N at once, each worker pinned to one GPU by
CUDA_VISIBLE_DEVICES (sessions.run_jobs), so the whole table takes about as long as its
slowest system. Each run records the GPU index it ran on (``gpu``).

    python -m scripts.bench.train --systems jaxft,jaxft_lean,hf_ckpt,hf_nockpt,unsloth \\
        --workloads 1b_2x4096,8b_4096,8b_16384,qwen3_8b_4096,8b_packed_16384 \\
        --steps 12 --budget-s 520 --out $OUT/bench_train.json --md $OUT/bench_train.md
    python -m scripts.bench.train --gpus all ...   # 8 x H200: every system on its own GPU at once
    python -m scripts.bench.train --tiny --systems hf_nockpt,jaxft --out /tmp/b.json --md /tmp/b.md
    python -m scripts.bench.train --systems jaxft_dpo,trl_dpo,unsloth_dpo --workloads 8b_dpo_2048 ...  # DPO

Unsloth is not on the device image: pass --unsloth-wheels DIR (default .peers/unsloth, filled by
/work/shared/peers/unsloth-wheels.sh and carried to the device); the harness installs it into a
private --target folder that only the Unsloth worker sees on its PYTHONPATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from .gpus import _gpu_name, resolve_gpus
from .harness import ALL_SYSTEMS, DEFAULT_SYSTEMS, DONE_STATUSES, DPO_SYSTEMS, REPO, REPORT_RESERVE_S, Bench
from .workloads import ADAMW, DEFAULT_WORKLOADS, LORA, SHAPES, TINY_WORKLOADS, WORKLOADS, get_workload, moe_layout

MIN_TIMED_STEPS = 10


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma list of {', '.join(ALL_SYSTEMS)}")
    p.add_argument("--workloads", default=None,
                   help=f"comma list of {', '.join(WORKLOADS)} (default: the 5 real ones; "
                        "--tiny: the tiny ones)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 12; --tiny 3)")
    p.add_argument("--warmup", type=int, default=None,
                   help="leading steps excluded from timing (default 2; --tiny 1)")
    p.add_argument("--out", required=True, help="result JSON path")
    p.add_argument("--md", default=None, help="markdown table path (default: --out with .md)")
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke test of the whole pipeline on tiny shapes (hidden 64, 2 layers, seq 128)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="per-task timeout: a session is killed when none of its tasks finished for this "
                        "long (the first task includes imports and the model load; default 420; --tiny 240)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="overall wall-clock budget: sessions are killed at its end (keeping "
                        f"{REPORT_RESERVE_S:.0f} s for the report); tasks not started are 'skipped'")
    p.add_argument("--workdir", default=None, help="scratch dir (models, logs); default a new temp dir")
    p.add_argument("--keep-models", action="store_true",
                   help="keep saved model dirs at the end (with --workdir, a later call reuses them)")
    p.add_argument("--logs", default=None,
                   help="folder for each session's stdout/stderr tail, one subfolder per session "
                        "(default: bench_train_logs beside --out; '' to keep none)")
    p.add_argument("--resume", default=None,
                   help="earlier result JSON: its ok/oom runs are kept and not run again")
    p.add_argument("--unsloth-wheels", default=os.path.join(REPO, ".peers", "unsloth"))
    p.add_argument("--gpus", default="1",
                   help="how many GPUs of this host to use, or 'all' (every GPU nvidia-smi lists): with "
                        "N > 1 up to N sessions run at once, each pinned to its own GPU (default 1: serial)")
    p.add_argument("--no-ceiling", action="store_true", help="skip the matmul ceiling (MFU '-')")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    args = p.parse_args(argv)
    args.systems = _split(args.systems, ALL_SYSTEMS, "--systems")
    wl_default = TINY_WORKLOADS if args.tiny else DEFAULT_WORKLOADS
    if all(s in DPO_SYSTEMS for s in args.systems):
        wl_default = [w for w, spec in WORKLOADS.items() if spec.dpo and spec.tiny == args.tiny]
    args.workloads = _split(args.workloads or ",".join(wl_default), tuple(WORKLOADS), "--workloads")
    args.steps = args.steps if args.steps is not None else (3 if args.tiny else 12)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    args.timeout_s = args.timeout_s if args.timeout_s is not None else (240.0 if args.tiny else 420.0)
    args.md = args.md or os.path.splitext(args.out)[0] + ".md"
    if args.logs is None:
        args.logs = os.path.join(os.path.dirname(os.path.abspath(args.out)), "bench_train_logs")
    if args.warmup < 0 or args.steps - args.warmup < 1:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if not args.tiny and args.steps - args.warmup < MIN_TIMED_STEPS:
        p.error(f"need >= {MIN_TIMED_STEPS} timed steps: --steps {args.steps} - --warmup "
                f"{args.warmup} = {args.steps - args.warmup} (e.g. --steps 12 --warmup 2)")
    mixed = [w for w in args.workloads if get_workload(w).tiny != args.tiny]
    if mixed:
        p.error(f"workloads {mixed} are {'not ' if args.tiny else ''}tiny; "
                f"{'--tiny takes ' + ', '.join(TINY_WORKLOADS) if args.tiny else 'add --tiny'}")
    dpo_workloads = [w for w in WORKLOADS if get_workload(w).dpo]
    wrong = [f"{s} x {w}" for s in args.systems for w in args.workloads if (s in DPO_SYSTEMS) != get_workload(w).dpo]
    if wrong:
        p.error(f"{', '.join(wrong)}: the DPO systems ({', '.join(DPO_SYSTEMS)}) train the DPO workloads "
                f"({', '.join(dpo_workloads)}) and the other systems the other workloads; run them in separate "
                "calls (scripts/gpu_check.sh: one TRAIN_PLAN pass each, 'a|w1|s;b|w2|s')")
    if args.device == "auto":
        args.device = "cpu" if args.tiny or _gpu_name() is None else "cuda"
    args.gpu_ids, args.gpu_names = resolve_gpus(args.gpus, p)
    return args


def _split(text: str, known: tuple[str, ...], flag: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in known]
    if bad or not items:
        raise SystemExit(f"{flag}: unknown {bad or 'empty list'}; choose from {', '.join(known)}")
    return list(dict.fromkeys(items))


def _commit(explicit: str | None) -> str:
    if explicit:
        return explicit
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + (" (dirty)" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "unknown (no git metadata in this copy; pass --commit)"


def new_report(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    command = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable, REPO)
                                                 if sys.executable.startswith(REPO) else "python",
                                                 "-m", "scripts.bench.train"] + argv)
    return {
        "meta": {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                 "commit": _commit(args.commit), "command": command,
                 "device": args.device, "device_name": _gpu_name() or args.device,
                 "systems": args.systems, "workloads": args.workloads, "steps": args.steps,
                 "warmup": args.warmup, "tiny": args.tiny, "timeout_s": args.timeout_s,
                 "concurrent_gpus": len(args.gpu_ids) if args.gpu_ids else 1,
                 **({"gpus": args.gpu_names} if args.gpu_names else {}),
                 "lora": dataclasses.asdict(LORA), "adamw": dataclasses.asdict(ADAMW),
                 "versions": {"harness": {"python": sys.version.split()[0]}}},
        "ceiling": {}, "workloads": {}, "models": {}, "runs": [],
        "notes": [
            "Each system ran in one worker process per session (torch: all workloads; JAX: one "
            "session per model shape, workloads in ascending expected memory); consecutive tasks on "
            "one shape reuse the loaded base model, each task starts from the same LoRA init with a "
            "fresh optimizer. Peak memory is the device allocator's peak of the training steps with "
            "the weights resident: torch max_memory_allocated, reset just before the first step "
            "(Unsloth's offload planner resets it there too); JAX memory_stats()['peak_bytes_in_use'] "
            "when it rose during the task's steps, else (marked *) the static estimate bytes in use "
            "before the first step + the compiled step's temp + output - alias bytes.",
            "All systems load the same random-weight bf16 model directory and train on the same "
            "token ids (SHA-256 checked); LoRA B starts at 0, so step-0 losses should agree.",
            "HF packed (padding-free) path: position_ids restart per document with no "
            "attention_mask and use_cache=False; transformers then builds a block-diagonal causal "
            "mask and SDPA runs dense masked attention (no varlen kernel with sdpa).",
            "Statuses: oom = ran out of device memory (a result); not_run = system unavailable "
            "or not implemented; skipped = time budget or missing model; timeout/crashed = see raw.",
        ] + workload_notes(args.workloads) + ([concurrency_note(args.gpu_ids, args.gpu_names)] if args.gpu_ids else []),
    }


def workload_notes(workloads: list[str]) -> list[str]:
    """Notes for the MoE and vision-language rows, when the run has any."""
    shapes = [SHAPES[name] for name in dict.fromkeys(get_workload(n).shape_name for n in workloads)]
    notes = []
    if any(moe_layout(sh) is not None for sh in shapes):
        notes.append(
            "MoE rows (Qwen3-MoE, GPT-OSS): every system trains LoRA on the attention linears and expert LoRA on "
            f"the fused expert parameters ({', '.join(LORA.expert_targets)}: PEFT target_parameters, jaxft "
            "lora_target_parameters, Unsloth target_parameters), rank r on every expert; gate/up/down_proj are not "
            "passed as target_modules (PEFT's transformers-5 MoE conversion would turn them into rank-2r expert "
            "LoRA on gate_up). Useful FLOPs count the router and the top-k experts a token runs, not all experts.")
    if any(get_workload(n).dpo for n in workloads):
        notes.append(
            "DPO rows: each step trains the workload's preference pairs (sigmoid loss, beta 0.1; the reference is the "
            "base model: jaxft zeroes its LoRA scales, TRL disables the adapter or, for a model passed already "
            "wrapped, as Unsloth's is, copies the initial adapter as 'ref': settings.reference) and runs the "
            "reference forward inside the step. Each side of a pair, prompt + chosen and prompt + rejected, is "
            "seq_len tokens, the prompt the first half; tokens/s counts every token of both sides (the prompt "
            "twice: both forwards run on it); jaxft holds a pair in one row of 2 x seq_len (two documents), TRL in "
            "two rows. LoRA B starts at 0, so the policy is the reference at step 0 and every system's first loss "
            "is ln 2 = 0.6931. Useful FLOPs add the reference forward (2 x P_frozen per token, 4 x D per pair and "
            "head).")
    if any(sh.is_vlm for sh in shapes):
        notes.append(
            "Vision-language rows (Qwen2.5-VL): one synthetic image per row (seeded uniform noise, processed by "
            "transformers' Qwen2-VL image processor with the model's preprocessor_config.json) after 16 text "
            "tokens, then text to the row length; tokens/s counts text + image tokens (the language model runs "
            "on both; seq_len is their sum); image tokens carry no loss. Every system gets the same token ids "
            "and pixel values (the data SHA-256 covers the pixels) and adapts the language model's q..down "
            "linears only (jaxft finetune_vision_layers=false, PEFT a regex on model.language_model.layers, "
            "Unsloth FastVisionModel finetune_vision_layers=False); the vision tower and merger are frozen, so "
            "useful FLOPs add the tower's forward only.")
    return notes


def concurrency_note(gpu_ids: list[int], gpu_names: list[str]) -> str:
    return (f"Systems ran concurrently, each on its own GPU of one host: up to {len(gpu_ids)} sessions at "
            "once, each worker pinned by CUDA_VISIBLE_DEVICES to the GPU in the run's `gpu` field (a "
            "session continuing a dead one stays on its GPU). The matmul ceilings and the model saves ran "
            f"first, alone, on GPU {gpu_ids[0]}. Concurrent workers share the host's CPUs, RAM and /dev/shm. "
            f"GPUs (nvidia-smi): {'; '.join(gpu_names)}.")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_train_")
    os.makedirs(workdir, exist_ok=True)
    report = new_report(args, argv)
    if args.resume:
        with open(args.resume) as f:
            old = json.load(f)
        # Every finished run is kept (the table accumulates over resumed passes); the selected ones are
        # not run again.
        report["runs"] = [r for r in old.get("runs", []) if r["summary"]["status"] in DONE_STATUSES]
        report["workloads"].update(old.get("workloads", {}))
        report["models"].update(old.get("models", {}))
        old_meta = old.get("meta", {})
        report["meta"]["resumed_commands"] = old_meta.get("resumed_commands", []) + (
            [old_meta["command"]] if "command" in old_meta else [])
        for side, versions in old_meta.get("versions", {}).items():
            report["meta"]["versions"].setdefault(side, {}).update(versions)
        report["ceiling"] = {k: v for k, v in old.get("ceiling", {}).items() if k in ("torch", "jax")}
        report["notes"].append(f"resumed from {args.resume} ({len(report['runs'])} runs kept)")
    bench = Bench(args, workdir, report, time.perf_counter())
    print(f"[bench] device={args.device} workdir={workdir} systems={args.systems} "
          f"workloads={args.workloads} steps={args.steps} warmup={args.warmup}", flush=True)
    try:
        bench.run()
    finally:
        bench.save()
        bench.remove_models()
        if not args.workdir and not args.keep_models:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"[bench] wrote {args.out} and {args.md}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
