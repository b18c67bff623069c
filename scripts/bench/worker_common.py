"""The contract between the benchmark harness and its per-system worker processes.

The harness writes a task file and starts ``python <worker script> --task TASKS --out RESULTS``.
The task file holds one task (a JSON object, for a one-off run by hand) or a session (a JSON list
of tasks): the worker runs a session's tasks in order in one process, so imports, Unsloth's
patching and (for consecutive tasks on the same model_dir) the loaded base model are paid once.
After EVERY task it rewrites the result file (atomically) with the list of finished results, so a
crash, OOM kill or timeout keeps the tasks finished before it; the harness starts a new session
for the tasks after the one that died. A training worker runs ``steps`` optimizer steps and
reports raw measurements; the harness derives every statistic (median step time over the steps
after the warm-up, tokens/s, MFU) itself, identically for all systems.

A training result (what a ``run_*`` function returns) holds:

    step_times_s       list[float], one per step, wall time of the step with the device
                       synchronised at its end (torch.cuda.synchronize / block_until_ready);
                       the batches are already on the device before the clock starts.
    losses             list[float], one per step: the training loss that step computed.
    peak_memory_bytes  int, this task's device memory peak (torch: max_memory_allocated after a
                       reset just before the first step; JAX: see jaxft_worker.py, which
                       has no peak reset and so may fall back to a static estimate).
    peak_memory_source "allocator" (measured) or "static_estimate" (JAX only; see above).
    data_sha256        TokenData.sha256 of the batches trained on (proves identical data).
    optional: lora_param_dtype (str), trainable_params (int), settings (dict: what "best
              settings" means for the system), versions (dict), device_name (str),
              base_model_reused (bool), extra (dict of anything else worth keeping), notes (str).

``worker_main`` adds ``status``: "ok", "oom" (an out-of-memory is a result, not a crash),
"not_run" (the system raised NotImplementedError or could not be imported) or "error", plus
``wall_s`` (the task's own wall time inside the worker) and ``session_index``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
import traceback
from typing import Any, Callable

import yaml

from .workloads import Workload, get_workload

STATUSES = ("ok", "oom", "not_run", "error", "timeout", "crashed", "skipped")
# The jaxft benchmark recipes: every mode is a `jaxft-train` YAML here (docs/benchmarks.md names it per row).
BENCH_RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "examples", "bench")
_OOM_MARKERS = ("out of memory", "outofmemoryerror", "resource_exhausted", "resource exhausted",
                "cuda error: out of memory", "failed to allocate")


def jaxft_modes() -> tuple[str, ...]:
    """The jaxft benchmark modes, one per recipe `examples/bench/<mode>.yaml`: "fast" (system "jaxft") first, then
    the others (systems "jaxft_<mode>") by name. A new mode is a new YAML file, and nothing else."""
    names = sorted(f.removesuffix(".yaml") for f in os.listdir(BENCH_RECIPES) if f.endswith(".yaml"))
    return ("fast", *(n for n in names if n != "fast"))


def recipe_keys(mode: str) -> dict[str, Any]:
    """The keys of the jaxft benchmark mode's recipe, examples/bench/<mode>.yaml."""
    with open(os.path.join(BENCH_RECIPES, f"{mode}.yaml"), encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def trains_dpo(mode: str) -> bool:
    """Whether the mode's recipe trains DPO (`trainer: dpo`): its system takes the DPO workloads only."""
    return recipe_keys(mode).get("trainer", "sft") == "dpo"


def trains_in_full(mode: str) -> bool:
    """Whether the mode's recipe trains every weight (`finetuning_type: full`) instead of LoRA adapters: its FLOPs
    count weight gradients and its trainable count is the whole model."""
    return recipe_keys(mode).get("finetuning_type", "lora") == "full"


def jaxft_dpo_modes() -> tuple[str, ...]:
    return tuple(m for m in jaxft_modes() if trains_dpo(m))


def jaxft_full_modes() -> tuple[str, ...]:
    return tuple(m for m in jaxft_modes() if trains_in_full(m))


@dataclasses.dataclass(frozen=True)
class Task:
    """What one worker process is asked to do (serialised as the task JSON)."""

    kind: str          # "train" or "save_model"
    system: str        # e.g. "hf_ckpt"; "" for save_model
    workload: str      # workload name (bench.workloads.WORKLOADS); for save_model any of the shape
    model_dir: str
    steps: int
    device: str        # "cuda" or "cpu"

    def __post_init__(self) -> None:
        if self.kind not in ("train", "save_model"):
            raise ValueError(f"Task.kind={self.kind!r} must be 'train' or 'save_model'")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"Task.device={self.device!r} must be 'cuda' or 'cpu'")
        if self.kind == "train" and self.steps < 1:
            raise ValueError(f"Task.steps={self.steps} must be >= 1")
        get_workload(self.workload)  # raises with the list of known names

    @property
    def workload_obj(self) -> Workload:
        return get_workload(self.workload)

    def dump(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=2)

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> "Task":
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: a task must be a JSON object, got {type(raw).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - fields
        if unknown:
            raise ValueError(f"{where}: unknown task keys {sorted(unknown)}; expected {sorted(fields)}")
        return cls(**raw)

    @classmethod
    def load(cls, path: str) -> "Task":
        with open(path) as f:
            return cls.from_dict(json.load(f), path)


def dump_session(tasks: list[Task], path: str) -> None:
    """Write a session task file: a JSON list of tasks, run in order by one worker process."""
    with open(path, "w") as f:
        json.dump([dataclasses.asdict(t) for t in tasks], f, indent=2)


def load_tasks(path: str) -> tuple[list[Task], bool]:
    """(tasks, is_session): a JSON list is a session, a JSON object a single task."""
    with open(path) as f:
        raw = json.load(f)
    if isinstance(raw, list):
        if not raw:
            raise ValueError(f"{path}: the session holds no tasks")
        return [Task.from_dict(r, f"{path}[{i}]") for i, r in enumerate(raw)], True
    return [Task.from_dict(raw, path)], False


class ModelCache:
    """The one base model a session keeps loaded, reused by consecutive tasks with the same key.

    ``get(key, load)`` returns ``(value, reused)``. On a key change the old value is dropped and
    the device memory released BEFORE loading the next one (two 8B models need not fit at once).
    """

    def __init__(self) -> None:
        self._key: Any = None
        self._value: Any = None

    def holds(self, key: Any) -> bool:
        return self._value is not None and key == self._key

    def get(self, key: Any, load: Callable[[], Any]) -> tuple[Any, bool]:
        if self._value is not None and key == self._key:
            return self._value, True
        self.clear()
        self._value, self._key = load(), key
        return self._value, False

    def clear(self) -> None:
        self._key = self._value = None
        release_memory()


def release_memory() -> None:
    """Free what dropped references held: Python cycles, then torch's cached CUDA blocks.

    torch is only touched when the worker already imported it (the JAX worker never does); JAX
    frees a buffer as soon as its last reference dies, so gc is all it needs.
    """
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class SystemUnavailable(RuntimeError):
    """The system cannot run here (package not installed, needs a GPU, ...): reported as not_run."""


def is_oom_message(text: str) -> bool:
    low = text.lower()
    return any(m in low for m in _OOM_MARKERS)


def classify_exception(exc: BaseException) -> str:
    if isinstance(exc, (NotImplementedError, SystemUnavailable)):
        return "not_run"
    if type(exc).__name__ in ("OutOfMemoryError", "XlaRuntimeError", "JaxRuntimeError") \
            and is_oom_message(f"{type(exc).__name__} {exc}"):
        return "oom"
    if is_oom_message(str(exc)):
        return "oom"
    return "error"


def validate_train_result(result: dict[str, Any], steps: int) -> dict[str, Any]:
    """Check the raw measurements a training worker returned; raise ValueError naming the key."""
    if not isinstance(result, dict):
        raise ValueError(f"train result must be a dict, got {type(result).__name__}")
    for key in ("step_times_s", "losses"):
        vals = result.get(key)
        if not isinstance(vals, list) or len(vals) != steps:
            raise ValueError(f"train result[{key!r}] must be a list of {steps} floats, got {vals!r}")
        if not all(isinstance(v, (int, float)) for v in vals):
            raise ValueError(f"train result[{key!r}] holds non-numbers: {vals!r}")
    if any(not (t > 0 and math.isfinite(t)) for t in result["step_times_s"]):
        raise ValueError(f"train result['step_times_s'] must be finite and > 0: {result['step_times_s']}")
    mem = result.get("peak_memory_bytes")
    if not isinstance(mem, int) or mem < 0:
        raise ValueError(f"train result['peak_memory_bytes'] must be an int >= 0, got {mem!r}")
    if not isinstance(result.get("data_sha256"), str):
        raise ValueError("train result['data_sha256'] must be TokenData.sha256 of the data trained on")
    return result


def write_json(path: str, obj: Any) -> None:
    """Write atomically (temp file + rename): a worker killed mid-write leaves the previous file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(tmp, path)


RunFn = Callable[[Task, str, ModelCache], dict[str, Any]]


def run_one(run_fn: RunFn, task: Task, out_json: str, cache: ModelCache) -> dict[str, Any]:
    """One task's result record; every outcome (OOM, missing system, bad result) becomes a record."""
    base = {"system": task.system, "workload": task.workload, "kind": task.kind}
    t0 = time.perf_counter()
    try:
        result = run_fn(task, out_json, cache)
        if task.kind == "train":
            validate_train_result(result, task.steps)
        return {**base, "status": "ok", **result, "wall_s": time.perf_counter() - t0}
    except BaseException as exc:  # noqa: BLE001 - every outcome becomes a result
        if isinstance(exc, KeyboardInterrupt):
            raise
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        # A failed task may leave the cached base model half-modified (PEFT layers still injected,
        # a partial load): drop it, so the next task reloads from disk instead of inheriting it.
        cache.clear()
        # Returning leaves the except block, which drops the exception and its traceback (their
        # frames hold the failed task's tensors); the caller's release_memory() then frees them.
        return {**base, "status": classify_exception(exc), "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback_tail": tb[-4000:], "wall_s": time.perf_counter() - t0}


def worker_main(run_fn: RunFn, argv: list[str] | None = None) -> int:
    """Parse ``--task/--out``; run every task in order with ``run_fn(task, out_json, cache)``.

    A session's result file is the list of finished results, rewritten after every task; a single
    task's result file is that one result. Every outcome is written as a result (exit code 0) so
    the harness can tell an OOM or a missing system from a crash.
    """
    p = argparse.ArgumentParser()
    p.add_argument("--task", required=True, help="task JSON: one object, or a list (a session)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    tasks, is_session = load_tasks(args.task)
    cache = ModelCache()
    results: list[dict[str, Any]] = []
    for i, task in enumerate(tasks):
        if i and (task.model_dir, task.device) != (tasks[i - 1].model_dir, tasks[i - 1].device):
            cache.clear()  # the next task loads another model: free this one first
        out = run_one(run_fn, task, args.out, cache)
        release_memory()  # the finished task's optimizer state, activations, grads
        results.append({**out, "session_index": i})
        write_json(args.out, results if is_session else results[0])
        print(f"[worker] task {i + 1}/{len(tasks)} {task.system or task.kind} {task.workload}: "
              f"{out['status']} in {out['wall_s']:.1f} s", file=sys.stderr, flush=True)
    return 0
