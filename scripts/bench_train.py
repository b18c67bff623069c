#!/usr/bin/env python
"""LoRA training benchmark: jaxft vs HF transformers + PEFT vs Unsloth, one process per system.

Every system trains the same random-weight model directory (saved once per shape on the device
with save_pretrained), on the same token ids (bench.workloads.make_token_data, checked by
SHA-256), with the same LoRA settings and AdamW, for the same number of steps.

Order of work: the matmul ceilings; one session saving every needed model directory (on /dev/shm
when it has room: tmpfs writes and reads are far faster than disk); then, in --systems order, one
worker session per system: a torch system runs all its workloads in one process (consecutive tasks
on one shape reuse the loaded base model), a JAX system one process per model shape, with the
shape's workloads in ascending expected memory (JAX cannot reset its peak counter, see
bench_jaxft_worker.py). Within a session each task still starts from the same LoRA init, a fresh
optimizer and its own data. Results are saved after every task (JSON + markdown), so a run cut
short still leaves a valid partial table; a session that dies (timeout, crash) costs the task it
died in, and a new session runs the tasks after it (bench/sessions.py).

With --gpus N > 1 (one host), the ceilings and the model saves run first, alone, on the first
GPU; then the same queue of sessions runs up to N at once, each worker pinned to one GPU by
CUDA_VISIBLE_DEVICES (bench.sessions.run_jobs), so the whole table takes about as long as its
slowest system. Each run records the GPU index it ran on (``gpu``).

    python scripts/bench_train.py --systems jaxft,jaxft_lean,hf_ckpt,hf_nockpt,unsloth \\
        --workloads 1b_2x4096,8b_4096,8b_16384,qwen3_8b_4096,8b_packed_16384 \\
        --steps 12 --budget-s 520 --out $OUT/bench_train.json --md $OUT/bench_train.md
    python scripts/bench_train.py --gpus all ...   # 8 x H200: every system on its own GPU at once
    python scripts/bench_train.py --tiny --systems hf_nockpt,jaxft --out /tmp/b.json --md /tmp/b.md

Unsloth is not on the device image: pass --unsloth-wheels DIR (default .peers/unsloth, filled by
/work/shared/peers/unsloth-wheels.sh and carried to the device); the harness installs it into a
private --target folder that only the Unsloth worker sees on its PYTHONPATH.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the bench package beside us

from bench.report import first_loss_spread, markdown, summarise_run  # noqa: E402
from bench.sessions import (Job, SessionRunner, keep_logs, pin_env, run_jobs,  # noqa: E402,F401 (re-exported)
                            run_subprocess)
from bench.workloads import (ADAMW, DEFAULT_WORKLOADS, LORA, SHAPES, TINY_WORKLOADS,  # noqa: E402
                             WORKLOADS, ModelShape, Workload, get_workload, make_token_data,
                             moe_layout, param_counts, useful_flops)
from bench.worker_common import Task, jaxft_modes  # noqa: E402

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(SCRIPTS)
# jaxft systems: "jaxft" (examples/bench/fast.yaml) and "jaxft_<mode>" (examples/bench/<mode>.yaml).
JAXFT_MODES = jaxft_modes()[1:]
# Torch systems whose worker needs the carried peer wheels on its path (Unsloth; bitsandbytes for HF QLoRA).
PEER_WHEEL_SYSTEMS = ("unsloth", "unsloth_4bit", "hf_qlora")
WORKER = {"jaxft": "bench_jaxft_worker.py", **{f"jaxft_{m}": "bench_jaxft_worker.py" for m in JAXFT_MODES},
          **{s: "bench_torch_worker.py" for s in ("hf_ckpt", "hf_nockpt") + PEER_WHEEL_SYSTEMS}}
ALL_SYSTEMS = tuple(WORKER)
DEFAULT_SYSTEMS = ("jaxft", "jaxft_lean", "hf_ckpt", "hf_nockpt", "unsloth")  # the table's systems
DONE_STATUSES = ("ok", "oom")  # what --resume keeps
MIN_TIMED_STEPS = 10
REPORT_RESERVE_S = 15.0  # budget kept back to write the report after the last session
SHM = "/dev/shm"
FAKE_GPUS_ENV = "BENCH_FAKE_GPUS"  # tests: pretend nvidia-smi lists this many GPUs (read by discover_gpus only)


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
    args.gpu_ids, args.gpu_names = resolve_gpus(args.gpus, p)
    return args


def discover_gpus() -> list[tuple[int, str]]:
    """(index, "name, memory") of every GPU nvidia-smi lists; [] when there is none.

    The environment variable BENCH_FAKE_GPUS=K replaces the list with K fake GPUs, so the
    multi-GPU scheduling can be tested on a machine without any (the workers then run on the CPU,
    each still given its CUDA_VISIBLE_DEVICES).
    """
    fake = os.environ.get(FAKE_GPUS_ENV)
    if fake:
        if not fake.isdigit() or int(fake) < 1:
            raise SystemExit(f"{FAKE_GPUS_ENV}={fake!r} must be a positive integer (the number of fake GPUs)")
        return [(i, f"fake GPU {i} ({FAKE_GPUS_ENV})") for i in range(int(fake))]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    gpus = []
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        index, _, rest = line.partition(",")
        if index.strip().isdigit():
            gpus.append((int(index), rest.strip()))
    return gpus


def resolve_gpus(spec: str, p: argparse.ArgumentParser) -> tuple[list[int] | None, list[str] | None]:
    """--gpus N|all -> (GPU indices to pin sessions to, their names), or (None, None) for the
    serial path (N == 1: the workers' environment is left as it is, exactly as before --gpus)."""
    if spec == "1":
        return None, None
    if spec != "all" and not (spec.isdigit() and int(spec) >= 1):
        p.error(f"--gpus {spec!r}: give a positive number of GPUs or 'all'")
    gpus = discover_gpus()
    want = len(gpus) if spec == "all" else int(spec)
    if want > len(gpus) or not gpus:
        p.error(f"--gpus {spec}: nvidia-smi lists {len(gpus)} GPU(s) on this host"
                + (f" ({'; '.join(f'{i}: {n}' for i, n in gpus)})" if gpus else "")
                + "; ask for at most that many (or use --gpus 1)")
    if want == 1:
        return None, None
    return [i for i, _ in gpus[:want]], [f"{i}: {n}" for i, n in gpus[:want]]


def _serial_gpu(device: str) -> int | str | None:
    """The GPU a serial (--gpus 1) worker runs on: the first one CUDA_VISIBLE_DEVICES names, else 0."""
    if device != "cuda":
        return None
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if not first:
        return 0
    return int(first) if first.isdigit() else first


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
    models_dir: str | None = None  # set by save_models
    # Concurrent sessions (--gpus > 1) report from worker threads; the report is written under this.
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)

    def time_left(self) -> float:
        if self.args.budget_s is None:
            return float("inf")
        return self.args.budget_s - (time.perf_counter() - self.t_start)

    def min_start_s(self) -> float:
        return min(60.0, self.args.timeout_s)

    def run_timeout(self) -> float | None:
        """Timeout for the next one-shot subprocess, or None when the budget cannot fit a useful run."""
        timeout = min(self.args.timeout_s, self.time_left() - REPORT_RESERVE_S)
        return timeout if timeout >= self.min_start_s() else None

    def runner(self) -> SessionRunner:
        return SessionRunner(self.workdir, self.args.timeout_s,
                             lambda: self.time_left() - REPORT_RESERVE_S, self.min_start_s(), self.args.logs)

    def first_gpu_env(self, env: dict[str, str]) -> dict[str, str]:
        """Ceilings and model saves run alone before the sessions: on the first GPU when several."""
        return pin_env(env, self.args.gpu_ids[0] if self.args.gpu_ids else None)

    def gpu_of(self, raw: dict[str, Any]) -> int | str | None:
        """The GPU a task ran on: run_jobs sets raw["gpu"] when it pins; the serial path's workers
        run where the inherited environment says; None for a task no session started for."""
        if "gpu" in raw:
            return raw["gpu"]
        return _serial_gpu(self.args.device) if raw.get("session") else None

    def save(self) -> None:
        with self.lock:
            for name in self.report["workloads"]:
                self.report["workloads"][name]["first_loss_spread"] = first_loss_spread(
                    self.report["runs"], name)
            os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
            # Temp file + rename: a harness killed mid-write keeps the previous valid report.
            for path, text in ((self.args.out, json.dumps(self.report, indent=2, default=str)),
                               (self.args.md, markdown(self.report))):
                with open(path + ".tmp", "w") as f:
                    f.write(text)
                os.replace(path + ".tmp", path)

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
                                      self.first_gpu_env(_worker_env(self.args.device, [], run_dir)))
            ceil[fw]["gpu"] = self.args.gpu_ids[0] if self.args.gpu_ids else _serial_gpu(self.args.device)
            keep_logs(run_dir, self.args.logs)
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
        flops = [useful_flops(w.shape, w.tokens_per_step, int(p), image_grids=data.image_grids(i))
                 for i, p in enumerate(data.attention_pairs)]
        self.report["workloads"][name] = {
            **w.to_dict(), "shape": w.shape_name, "params": param_counts(w.shape),
            "data": data.stats(), "useful_flops_per_step": sum(flops[self.args.warmup:])
            / len(flops[self.args.warmup:])}
        return flops, data.sha256

    def models_root(self, shapes: list[str]) -> str:
        """Where the models go (`models_place`): /dev/shm, or the workdir; a SystemExit naming the sizes if neither
        holds them."""
        sizes = [model_bytes(SHAPES[sh]) for sh in shapes]
        shm = shutil.disk_usage(SHM).free if os.path.isdir(SHM) else 0
        place = models_place(sizes, shm, ram_available_bytes(), shutil.disk_usage(self.workdir).free)
        if place == "shm":
            # Named after the workdir, so a kept --workdir finds its kept models again.
            tag = hashlib.sha1(os.path.abspath(self.workdir).encode()).hexdigest()[:12]
            return os.path.join(SHM, f"bench_train_models_{tag}")
        if place == "disk":
            return os.path.join(self.workdir, "models")
        raise SystemExit(f"bench_train.py: {place}; the shapes: {', '.join(shapes)}")

    def save_models(self, workloads: list[str]) -> dict[str, str | None]:
        """Save the model of each workload's shape in one session; {shape: None or why it failed}."""
        first: dict[str, str] = {}
        for name in workloads:
            first.setdefault(get_workload(name).shape_name, name)
        self.models_dir = self.models_root(list(first))
        tasks = [Task("save_model", "", name, os.path.join(self.models_dir, shape), 1, self.args.device)
                 for shape, name in first.items()]
        errors: dict[str, str | None] = {shape: "model was not saved" for shape in first}

        def on_result(task: Task, raw: dict[str, Any]) -> None:
            shape = task.workload_obj.shape_name
            self.report["models"][shape] = {**raw, "gpu": self.gpu_of(raw)}
            errors[shape] = None if raw.get("status") == "ok" else \
                f"{raw.get('status')}: {raw.get('error', '')}"[:300]
            print(f"[bench] model {shape}: {raw.get('status')} in {raw.get('wall_s', 0):.1f} s "
                  f"({'reused' if raw.get('reused') else task.model_dir})", flush=True)

        # Alone, before any training session (on the first GPU when several).
        save = Job("save_models", os.path.join(SCRIPTS, "bench_torch_worker.py"), tasks,
                   lambda run_dir: _worker_env(self.args.device, [], run_dir), on_result)
        run_jobs(self.runner(), [save], self.args.gpu_ids[:1] if self.args.gpu_ids else None)
        self.save()
        return errors

    def sessions(self, system: str, workloads: list[str]) -> list[tuple[str, list[str]]]:
        """(session name, workloads in run order): torch systems one session, JAX one per shape."""
        if not system.startswith("jaxft"):
            return [(system, workloads)]
        by_shape: dict[str, list[str]] = {}
        for name in workloads:
            by_shape.setdefault(get_workload(name).shape_name, []).append(name)
        return [(f"{system}__{shape}", names) for shape, names in by_shape.items()]

    def system_jobs(self, system: str, workloads: list[str], model_errors: dict[str, str | None],
                    infos: dict[str, tuple[list[float], str]]) -> list[Job]:
        """The system's sessions to queue; workloads that cannot run are recorded right away."""
        runnable = []
        for name in workloads:
            error = model_errors[get_workload(name).shape_name]
            if error is not None:
                self.record(system, name, {"status": "skipped", "error": f"model dir not available: {error}"},
                            *infos[name])
            elif system in PEER_WHEEL_SYSTEMS and self.unsloth_error and self.args.device == "cuda":
                self.record(system, name, {"status": "not_run", "error": self.unsloth_error}, *infos[name])
            else:
                runnable.append(name)
        path = self.unsloth_path if system in PEER_WHEEL_SYSTEMS else []
        jobs = []
        for session, names in self.sessions(system, runnable):
            tasks = [Task("train", system, name, os.path.join(self.models_dir, get_workload(name).shape_name),
                          self.args.steps, self.args.device) for name in names]
            jobs.append(Job(session, os.path.join(SCRIPTS, WORKER[system]), tasks,
                            lambda run_dir: _worker_env(self.args.device, path, run_dir),
                            lambda task, raw: self.record(system, task.workload, raw, *infos[task.workload])))
        return jobs

    def record(self, system: str, workload: str, raw: dict[str, Any], flops: list[float],
               sha: str) -> None:
        w = get_workload(workload)
        summary = summarise_run(raw, w, self.args.warmup, flops, sha,
                                param_counts(w.shape)["lora"],
                                self.report["ceiling"].get("used_flops_per_s"))
        gpu = self.gpu_of(raw)
        with self.lock:
            runs = [r for r in self.report["runs"] if (r["system"], r["workload"]) != (system, workload)]
            runs.append({"system": system, "workload": workload, "session": raw.get("session"), "gpu": gpu,
                         "summary": summary, "raw": raw})
            order = {name: i for i, name in enumerate(self.args.workloads + self.args.systems)}
            self.report["runs"] = sorted(runs, key=lambda r: (order.get(r["workload"], 1 << 30),
                                                              order.get(r["system"], 1 << 30)))
            if raw.get("versions"):
                side = ("jax_side" if system.startswith("jaxft")
                        else "unsloth" if system.startswith("unsloth") else "torch_side")
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
        if any(s in PEER_WHEEL_SYSTEMS for s in self.args.systems) and self.args.device == "cuda":
            self.unsloth_path, self.unsloth_error = ensure_unsloth(self.args.unsloth_wheels, self.workdir)
        order = run_order(self.args.workloads)
        infos = {name: self.workload_info(name) for name in order}
        todo = {s: [n for n in order if not self.done(s, n)] for s in self.args.systems}
        needed = [n for n in order if any(n in names for names in todo.values())]
        if not needed:
            return
        model_errors = self.save_models(needed)  # every model dir exists before any training starts
        jobs = [job for system in self.args.systems
                for job in self.system_jobs(system, todo[system], model_errors, infos)]
        run_jobs(self.runner(), jobs, self.args.gpu_ids)

    def remove_models(self) -> None:
        if self.models_dir and not self.args.keep_models:
            shutil.rmtree(self.models_dir, ignore_errors=True)


def models_place(sizes: list[int], shm_free: int, ram_available: int, disk_free: int) -> str:
    """"shm" when /dev/shm holds every model with 20% to spare AND the host RAM holds them plus the largest again
    (/dev/shm is RAM, and the worker saving a model holds it in RAM too: two MoE shapes, 57 + 39 GiB, passed the
    /dev/shm check alone on the 128 GiB H200 host and the save was killed for memory); else "disk" when the
    workdir's disk holds them with 20% to spare; else why neither does (one line)."""
    need, largest = sum(sizes), max(sizes, default=0)
    if shm_free > 1.2 * need and ram_available > need + largest:
        return "shm"
    if disk_free > 1.2 * need:
        return "disk"
    gib = 2 ** 30
    return (f"the models need {need / gib:.1f} GiB (+20%), and /dev/shm has {shm_free / gib:.1f} GiB free with "
            f"{ram_available / gib:.1f} GiB of RAM available (it needs the models plus the largest, "
            f"{(need + largest) / gib:.1f} GiB), the workdir's disk {disk_free / gib:.1f} GiB: run fewer model "
            f"shapes per call (scripts/gpu_check.sh: one TRAIN_PLAN pass per shape, 'a|w1|s;b|w2|s')")


def ram_available_bytes() -> int:
    """MemAvailable of /proc/meminfo (0 where there is none: then /dev/shm is not chosen)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def model_bytes(shape: ModelShape) -> int:
    """bf16 bytes of a shape's saved weights: the stored matmuls (every expert, lm_head included) plus an
    untied embedding (and a VLM's vision tower, biases and norms left out: a fraction of a percent)."""
    counts = param_counts(shape)
    embed = 0 if shape.get("tie_word_embeddings") else shape.get("vocab_size") * shape.get("hidden_size")
    vision = counts.get("vision_per_patch", 0) + counts.get("vision_per_merged", 0)
    return 2 * (counts["stored_matmul"] + embed + vision)


def run_order(workloads: list[str]) -> list[str]:
    """Workloads grouped by shape (first-seen order), each group in ascending expected memory:
    fewer tokens first, and at equal tokens packed before dense (its attention is block-diagonal)."""
    shapes = list(dict.fromkeys(get_workload(n).shape_name for n in workloads))

    def key(name: str) -> tuple[int, int, int]:
        w: Workload = get_workload(name)
        return shapes.index(w.shape_name), w.batch * w.seq_len, 0 if w.packed else 1

    return sorted(workloads, key=key)


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
