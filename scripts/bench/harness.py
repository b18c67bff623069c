"""The run of `python -m scripts.bench.train` (`Bench`): the matmul ceilings, one session saving the model
directories (`models_place`: /dev/shm or disk), one worker session per system and model shape (`run_order`), and
the report saved after every task; the systems and the worker module each runs as (`python -m`, the repository on
the worker's PYTHONPATH)."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

from .gpus import _serial_gpu
from .report import first_loss_spread, markdown, summarise_run
from .sessions import Job, SessionRunner, keep_logs, pin_env, run_jobs, run_subprocess
from .workloads import SHAPES, ModelShape, Workload, get_workload, make_token_data, param_counts, useful_flops
from .worker_common import Task, jaxft_dpo_modes, jaxft_full_modes, jaxft_modes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# jaxft systems: "jaxft" (examples/bench/fast.yaml) and "jaxft_<mode>" (examples/bench/<mode>.yaml).
JAXFT_MODES = jaxft_modes()[1:]
# Torch systems whose worker needs the carried peer wheels on its path (Unsloth; bitsandbytes for HF QLoRA; TRL and
# datasets for the DPO systems).
PEER_WHEEL_SYSTEMS = ("unsloth", "unsloth_4bit", "unsloth_full", "hf_qlora", "trl_dpo", "unsloth_dpo")
# The systems that train DPO, on the DPO workloads only (the others train SFT on the others).
DPO_SYSTEMS = tuple(f"jaxft_{m}" for m in jaxft_dpo_modes()) + ("trl_dpo", "unsloth_dpo")
FULL_SYSTEMS = tuple(f"jaxft_{m}" for m in jaxft_full_modes()) + ("unsloth_full",)  # every weight trained
JAXFT_WORKER, TORCH_WORKER = "scripts.bench.jaxft_worker", "scripts.bench.torch_worker"
WORKER = {"jaxft": JAXFT_WORKER, **{f"jaxft_{m}": JAXFT_WORKER for m in JAXFT_MODES},
          **{s: TORCH_WORKER for s in ("hf_ckpt", "hf_nockpt") + PEER_WHEEL_SYSTEMS}}
ALL_SYSTEMS = tuple(WORKER)
DEFAULT_SYSTEMS = ("jaxft", "jaxft_lean", "hf_ckpt", "hf_nockpt", "unsloth")  # the table's systems
DONE_STATUSES = ("ok", "oom")  # what --resume keeps
REPORT_RESERVE_S = 15.0  # budget kept back to write the report after the last session
SHM = "/dev/shm"


# ------------------------------------------------------------------------------------------------
# Subprocesses.
# ------------------------------------------------------------------------------------------------


def _worker_env(device: str, extra_pythonpath: list[str], run_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    # The repository first: the workers run as `python -m scripts.bench...` from their run folders.
    env["PYTHONPATH"] = os.pathsep.join([REPO] + extra_pythonpath + (
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
                w = self.report["workloads"][name]
                w["first_loss_spread"] = first_loss_spread(self.report["runs"], name)
                if w.get("dpo"):
                    w["first_logps_spread"] = first_loss_spread(self.report["runs"], name, "first_logps_chosen")
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
            cmd = [sys.executable, "-m", "scripts.bench.ceiling", "--framework", fw,
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

    def workload_info(self, name: str) -> tuple[dict[bool, list[float]], str]:
        """({full: useful FLOPs of each step}, the data's SHA-256): a LoRA (False) and a full fine-tuning (True)
        system run different FLOPs over the same steps."""
        w = get_workload(name)
        data = make_token_data(w, self.args.steps)
        flops = {full: [useful_flops(w.shape, w.tokens_per_step, int(p), image_grids=data.image_grids(i),
                                     reference_forward=w.dpo, full=full)
                        for i, p in enumerate(data.attention_pairs)] for full in (False, True)}
        timed = flops[False][self.args.warmup:]
        self.report["workloads"][name] = {
            **w.to_dict(), "shape": w.shape_name, "params": param_counts(w.shape),
            "data": data.stats(), "useful_flops_per_step": sum(timed) / len(timed)}
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
        raise SystemExit(f"scripts.bench.train: {place}; the shapes: {', '.join(shapes)}")

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
        save = Job("save_models", TORCH_WORKER, tasks,
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
            jobs.append(Job(session, WORKER[system], tasks,
                            lambda run_dir: _worker_env(self.args.device, path, run_dir),
                            lambda task, raw: self.record(system, task.workload, raw, *infos[task.workload])))
        return jobs

    def record(self, system: str, workload: str, raw: dict[str, Any], flops: dict[bool, list[float]],
               sha: str) -> None:
        w = get_workload(workload)
        full = system in FULL_SYSTEMS
        # A full fine-tune trains the whole model: its count is the saved model's (unknown in a resumed report).
        trainable = (self.report["models"].get(w.shape_name, {}).get("params") if full
                     else param_counts(w.shape)["lora"])
        summary = summarise_run(raw, w, self.args.warmup, flops[full], sha, trainable,
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

