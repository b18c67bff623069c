#!/usr/bin/env python
"""LoRA training benchmark: jaxft vs HF transformers + PEFT vs Unsloth, one process per run.

Every system trains the same random-weight model directory (saved once per shape on the device
with save_pretrained), on the same token ids (bench.workloads.make_token_data, checked by
SHA-256), with the same LoRA settings and AdamW, for the same number of steps. Each
(system, workload) pair runs in its own subprocess with a timeout, so its memory peak is its
own and an out-of-memory or a crash is recorded as a result. Results are written after every
run (JSON + markdown), so a run cut short still leaves a valid partial table.

    python scripts/bench_train.py --systems jaxft,hf_ckpt,hf_nockpt,unsloth \\
        --workloads 1b_2x4096,8b_4096,8b_16384,qwen3_8b_4096,8b_packed_16384 \\
        --steps 12 --out $OUT/bench_train.json --md $OUT/bench_train.md
    python scripts/bench_train.py --tiny --systems hf_nockpt --out /tmp/b.json --md /tmp/b.md

Unsloth is not on the device image: pass --unsloth-wheels DIR (default .peers/unsloth, filled by
/work/shared/peers/unsloth-wheels.sh and carried to the device); the harness installs it into a
private --target folder that only the Unsloth worker sees on its PYTHONPATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the bench package beside us

from bench.report import first_loss_spread, markdown, summarise_run  # noqa: E402
from bench.workloads import (ADAMW, DEFAULT_WORKLOADS, LORA, TINY_WORKLOADS, WORKLOADS,  # noqa: E402
                             get_workload, make_token_data, param_counts, useful_flops)
from bench.worker_common import Task, is_oom_message  # noqa: E402

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(SCRIPTS)
WORKER = {"jaxft": "bench_jaxft_worker.py", "jaxft_lean": "bench_jaxft_worker.py", "hf_ckpt": "bench_torch_worker.py",
          "hf_nockpt": "bench_torch_worker.py", "unsloth": "bench_torch_worker.py"}
ALL_SYSTEMS = tuple(WORKER)
DONE_STATUSES = ("ok", "oom")  # what --resume keeps
MIN_TIMED_STEPS = 10
LOG_KEEP_BYTES = 200_000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS),
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
                   help="per-run (per subprocess) timeout (default 420; --tiny 240)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="overall wall-clock budget; runs that cannot start in time are 'skipped'")
    p.add_argument("--workdir", default=None, help="scratch dir (models, logs); default a new temp dir")
    p.add_argument("--keep-models", action="store_true", help="keep saved model dirs at the end")
    p.add_argument("--logs", default=None,
                   help="folder for each run's stdout/stderr tail (default: bench_train_logs beside "
                        "--out; '' to keep none)")
    p.add_argument("--resume", default=None,
                   help="earlier result JSON: its ok/oom runs are kept and not run again")
    p.add_argument("--unsloth-wheels", default=os.path.join(REPO, ".peers", "unsloth"))
    p.add_argument("--no-ceiling", action="store_true", help="skip the matmul ceiling (MFU '-')")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    args = p.parse_args(argv)
    args.systems = _split(args.systems, ALL_SYSTEMS, "--systems")
    wl_default = TINY_WORKLOADS if args.tiny else DEFAULT_WORKLOADS
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
    if args.device == "auto":
        args.device = "cpu" if args.tiny or _gpu_name() is None else "cuda"
    return args


def _split(text: str, known: tuple[str, ...], flag: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in known]
    if bad or not items:
        raise SystemExit(f"{flag}: unknown {bad or 'empty list'}; choose from {', '.join(known)}")
    return list(dict.fromkeys(items))


def _gpu_name() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    return lines[0] if out.returncode == 0 and lines else None


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


# ------------------------------------------------------------------------------------------------
# Subprocesses.
# ------------------------------------------------------------------------------------------------


def _worker_env(device: str, extra_pythonpath: list[str], run_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(extra_pythonpath + [REPO] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update({
        # No network from any worker: everything is local (the model dir is on disk).
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "UNSLOTH_DISABLE_STATISTICS": "1",
        "UNSLOTH_COMPILE_LOCATION": os.path.join(run_dir, "unsloth_compiled_cache"),
        "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
    })
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["JAX_PLATFORMS"] = "cpu"
    return env


def run_subprocess(cmd: list[str], run_dir: str, out_path: str, timeout_s: float,
                   env: dict[str, str]) -> dict[str, Any]:
    """Run one worker; return its result JSON, or a timeout/crash record built from its logs."""
    os.makedirs(run_dir, exist_ok=True)
    log_out, log_err = os.path.join(run_dir, "stdout.log"), os.path.join(run_dir, "stderr.log")
    t0 = time.perf_counter()
    with open(log_out, "w") as fo, open(log_err, "w") as fe:
        proc = subprocess.Popen(cmd, cwd=run_dir, env=env, stdout=fo, stderr=fe,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session: it and its children
            rc = proc.wait()
    wall = time.perf_counter() - t0
    with open(log_err, errors="replace") as f:
        err_tail = f.read()[-3000:]
    if not timed_out and os.path.exists(out_path):
        with open(out_path) as f:
            result = json.load(f)
        result["wall_s"] = wall
        return result
    if timed_out:
        status, error = "timeout", f"killed after {timeout_s:.0f} s"
    else:
        status = "oom" if is_oom_message(err_tail) else "crashed"
        error = f"exit code {rc} without a result; stderr tail: {err_tail[-600:]}"
    return {"status": status, "error": error, "stderr_tail": err_tail, "wall_s": wall}


def ensure_unsloth(wheels_dir: str, workdir: str) -> tuple[list[str], str | None]:
    """PYTHONPATH entries that make ``import unsloth`` work, or an explanation why not."""
    if importlib.util.find_spec("unsloth") is not None:
        return [], None
    wheels = sorted(f for f in os.listdir(wheels_dir) if f.endswith(".whl")) \
        if os.path.isdir(wheels_dir) else []
    if not any(w.startswith("unsloth-") for w in wheels):
        return [], (f"unsloth is not installed and {wheels_dir} has no unsloth wheel "
                    "(run /work/shared/peers/unsloth-wheels.sh DIR and carry DIR)")
    target = os.path.join(workdir, "unsloth_site")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", target] + [os.path.join(wheels_dir, w) for w in wheels]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        return [], f"pip install of {wheels_dir} failed: {res.stderr[-800:]}"
    return [target], None


# ------------------------------------------------------------------------------------------------
# The benchmark.
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Bench:
    args: argparse.Namespace
    workdir: str
    report: dict[str, Any]
    t_start: float
    unsloth_path: list[str] = dataclasses.field(default_factory=list)
    unsloth_error: str | None = None

    def time_left(self) -> float:
        if self.args.budget_s is None:
            return float("inf")
        return self.args.budget_s - (time.perf_counter() - self.t_start)

    def run_timeout(self) -> float | None:
        """Timeout for the next subprocess, or None when the budget cannot fit a useful run."""
        left = self.time_left() - 15.0  # keep time to write the report
        timeout = min(self.args.timeout_s, left)
        return timeout if timeout >= min(60.0, self.args.timeout_s) else None

    def save(self) -> None:
        for name in self.report["workloads"]:
            self.report["workloads"][name]["first_loss_spread"] = first_loss_spread(
                self.report["runs"], name)
        os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
        with open(self.args.out, "w") as f:
            json.dump(self.report, f, indent=2, default=str)
        with open(self.args.md, "w") as f:
            f.write(markdown(self.report))

    def ceiling_frameworks(self) -> list[str]:
        """The frameworks of the selected systems (the full table measures both)."""
        fws = {"jax" if s.startswith("jaxft") else "torch" for s in self.args.systems}
        return [fw for fw in ("torch", "jax") if fw in fws]

    def ceilings(self) -> None:
        ceil = self.report["ceiling"]
        if self.args.no_ceiling:
            ceil["used_flops_per_s"] = None
            return
        for fw in self.ceiling_frameworks():
            if fw in ceil and ceil[fw].get("status") == "ok":
                continue
            timeout = self.run_timeout()
            if timeout is None:
                ceil[fw] = {"status": "skipped", "error": "budget"}
                continue
            run_dir = os.path.join(self.workdir, f"ceiling_{fw}")
            out = os.path.join(run_dir, "result.json")
            cmd = [sys.executable, os.path.join(SCRIPTS, "bench", "ceiling.py"), "--framework", fw,
                   "--device", self.args.device, "--out", out]
            ceil[fw] = run_subprocess(cmd, run_dir, out, timeout,
                                      _worker_env(self.args.device, [], run_dir))
            self.keep_logs(run_dir)
            print(f"[bench] ceiling {fw}: {ceil[fw].get('status')} "
                  f"{ceil[fw].get('flops_per_s', 0) / 1e12:.2f} TFLOP/s", flush=True)
        ok = [c["flops_per_s"] for c in (ceil.get("torch"), ceil.get("jax"))
              if c and c.get("status") == "ok"]
        ceil["used_flops_per_s"] = max(ok) if ok else None
        for fw in ("torch", "jax"):
            c = ceil.get(fw) or {}
            if c.get("status") == "ok":
                self.report["meta"]["versions"][fw + "_side"] = c.get("versions", {})
                self.report["meta"]["device_name"] = c.get("device_name") or self.report["meta"]["device_name"]
        self.save()

    def workload_info(self, name: str) -> tuple[list[float], str]:
        w = get_workload(name)
        data = make_token_data(w, self.args.steps)
        flops = [useful_flops(w.shape, w.tokens_per_step, int(p)) for p in data.attention_pairs]
        self.report["workloads"][name] = {
            **w.to_dict(), "shape": w.shape_name, "params": param_counts(w.shape),
            "data": data.stats(), "useful_flops_per_step": sum(flops[self.args.warmup:])
            / len(flops[self.args.warmup:])}
        return flops, data.sha256

    def save_model(self, shape_workload: str, model_dir: str) -> dict[str, Any]:
        timeout = self.run_timeout()
        if timeout is None:
            return {"status": "skipped", "error": "budget"}
        run_dir = os.path.join(self.workdir, "save_" + get_workload(shape_workload).shape_name)
        task = Task("save_model", "", shape_workload, model_dir, 1, self.args.device)
        return self._launch(task, run_dir, "bench_torch_worker.py", [], timeout)

    def _launch(self, task: Task, run_dir: str, script: str, pythonpath: list[str],
                timeout: float) -> dict[str, Any]:
        os.makedirs(run_dir, exist_ok=True)
        task_path, out = os.path.join(run_dir, "task.json"), os.path.join(run_dir, "result.json")
        task.dump(task_path)
        cmd = [sys.executable, os.path.join(SCRIPTS, script), "--task", task_path, "--out", out]
        result = run_subprocess(cmd, run_dir, out, timeout,
                                _worker_env(self.args.device, pythonpath, run_dir))
        self.keep_logs(run_dir)
        return result

    def keep_logs(self, run_dir: str) -> None:
        """Copy a run's stdout/stderr (last LOG_KEEP_BYTES of each) next to the result JSON."""
        if not self.args.logs:
            return
        dest = os.path.join(self.args.logs, os.path.basename(run_dir))
        os.makedirs(dest, exist_ok=True)
        for name in ("stdout.log", "stderr.log", "task.json"):
            src = os.path.join(run_dir, name)
            if os.path.exists(src):
                with open(src, "rb") as f:
                    f.seek(max(0, os.path.getsize(src) - LOG_KEEP_BYTES))
                    data = f.read()
                with open(os.path.join(dest, name), "wb") as f:
                    f.write(data)

    def train(self, system: str, workload: str, model_dir: str, model_error: str | None) -> dict[str, Any]:
        if model_error is not None:
            return {"status": "skipped", "error": f"model dir not available: {model_error}"}
        if system == "unsloth" and self.unsloth_error and self.args.device == "cuda":
            return {"status": "not_run", "error": self.unsloth_error}
        timeout = self.run_timeout()
        if timeout is None:
            return {"status": "skipped", "error": "budget exhausted"}
        task = Task("train", system, workload, model_dir, self.args.steps, self.args.device)
        path = self.unsloth_path if system == "unsloth" else []
        return self._launch(task, os.path.join(self.workdir, f"{system}__{workload}"),
                            WORKER[system], path, timeout)

    def record(self, system: str, workload: str, raw: dict[str, Any], flops: list[float],
               sha: str) -> None:
        w = get_workload(workload)
        summary = summarise_run(raw, w, self.args.warmup, flops, sha,
                                param_counts(w.shape)["lora"],
                                self.report["ceiling"].get("used_flops_per_s"))
        runs = [r for r in self.report["runs"] if (r["system"], r["workload"]) != (system, workload)]
        runs.append({"system": system, "workload": workload, "summary": summary, "raw": raw})
        order = {name: i for i, name in enumerate(self.args.workloads + self.args.systems)}
        self.report["runs"] = sorted(runs, key=lambda r: (order.get(r["workload"], 1 << 30),
                                                          order.get(r["system"], 1 << 30)))
        if raw.get("versions"):
            side = "jax_side" if system.startswith("jaxft") else ("unsloth" if system == "unsloth" else "torch_side")
            self.report["meta"]["versions"].setdefault(side, {}).update(raw["versions"])
        self.save()
        mfu = summary.get("mfu")
        print(f"[bench] {workload:>18} {system:>9}: {summary['status']}"
              + (f" {summary['median_step_s'] * 1e3:.1f} ms/step, {summary['tokens_per_s']:,.0f} tok/s, "
                 f"{summary['peak_memory_gib']:.2f} GiB, MFU {'-' if mfu is None else f'{100 * mfu:.1f}%'}, "
                 f"loss {summary['final_loss']:.4f}" if summary["status"] == "ok"
                 else f" {str(raw.get('error') or '')[:200]}"), flush=True)

    def done(self, system: str, workload: str) -> bool:
        return any((r["system"], r["workload"]) == (system, workload)
                   and r["summary"]["status"] in DONE_STATUSES for r in self.report["runs"])

    def run(self) -> None:
        self.ceilings()
        if "unsloth" in self.args.systems and self.args.device == "cuda":
            self.unsloth_path, self.unsloth_error = ensure_unsloth(self.args.unsloth_wheels, self.workdir)
        by_shape: dict[str, list[str]] = {}
        for name in self.args.workloads:
            by_shape.setdefault(get_workload(name).shape_name, []).append(name)
        for shape, names in by_shape.items():
            infos = {name: self.workload_info(name) for name in names}
            todo = [(s, n) for n in names for s in self.args.systems if not self.done(s, n)]
            if not todo:
                continue
            model_dir = os.path.join(self.workdir, "models", shape)
            saved = self.save_model(names[0], model_dir)
            self.report["models"][shape] = saved
            model_error = None if saved.get("status") == "ok" else \
                f"{saved.get('status')}: {saved.get('error', '')}"[:300]
            for system, name in todo:
                raw = self.train(system, name, model_dir, model_error)
                self.record(system, name, raw, *infos[name])
            if not self.args.keep_models:
                shutil.rmtree(model_dir, ignore_errors=True)


def new_report(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    command = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable, REPO)
                                                 if sys.executable.startswith(REPO) else "python",
                                                 os.path.relpath(os.path.abspath(__file__), REPO)] + argv)
    return {
        "meta": {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                 "commit": _commit(args.commit), "command": command,
                 "device": args.device, "device_name": _gpu_name() or args.device,
                 "systems": args.systems, "workloads": args.workloads, "steps": args.steps,
                 "warmup": args.warmup, "tiny": args.tiny, "timeout_s": args.timeout_s,
                 "lora": dataclasses.asdict(LORA), "adamw": dataclasses.asdict(ADAMW),
                 "versions": {"harness": {"python": sys.version.split()[0]}}},
        "ceiling": {}, "workloads": {}, "models": {}, "runs": [],
        "notes": [
            "Each (system, workload) ran in its own process. Peak memory is the device allocator's "
            "peak with the weights resident: torch max_memory_allocated, reset just before the "
            "first step (Unsloth's offload planner resets it there too); JAX "
            "memory_stats()['peak_bytes_in_use'] over the whole process.",
            "All systems load the same random-weight bf16 model directory and train on the same "
            "token ids (SHA-256 checked); LoRA B starts at 0, so step-0 losses should agree.",
            "HF packed (padding-free) path: position_ids restart per document with no "
            "attention_mask and use_cache=False; transformers then builds a block-diagonal causal "
            "mask and SDPA runs dense masked attention (no varlen kernel with sdpa).",
            "Statuses: oom = ran out of device memory (a result); not_run = system unavailable "
            "or not implemented; skipped = time budget or missing model; timeout/crashed = see raw.",
        ],
    }


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
        if not args.workdir and not args.keep_models:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"[bench] wrote {args.out} and {args.md}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
