"""The contract between the benchmark harness and its per-system worker processes.

The harness writes a task JSON and starts ``python <worker script> --task TASK --out RESULT``
in a fresh process (clean memory peak, clean imports). A training worker runs ``steps``
optimizer steps and reports raw measurements; the harness derives every statistic (median
step time over the steps after the warm-up, tokens/s, MFU) itself, identically for all systems.

A training result (what a ``run_*`` function returns) holds:

    step_times_s       list[float], one per step, wall time of the step with the device
                       synchronised at its end (torch.cuda.synchronize / block_until_ready);
                       the batches are already on the device before the clock starts.
    losses             list[float], one per step: the training loss that step computed.
    peak_memory_bytes  int, the device allocator's peak over the whole process
                       (torch: max_memory_allocated; JAX: memory_stats()['peak_bytes_in_use']).
    data_sha256        TokenData.sha256 of the batches trained on (proves identical data).
    optional: lora_param_dtype (str), trainable_params (int), settings (dict: what "best
              settings" means for the system), versions (dict), device_name (str),
              extra (dict of anything else worth keeping), notes (str).

``worker_main`` adds ``status``: "ok", "oom" (an out-of-memory is a result, not a crash),
"not_run" (the system raised NotImplementedError or could not be imported) or "error".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import traceback
from typing import Any, Callable

from bench.workloads import Workload, get_workload

STATUSES = ("ok", "oom", "not_run", "error", "timeout", "crashed", "skipped")
_OOM_MARKERS = ("out of memory", "outofmemoryerror", "resource_exhausted", "resource exhausted",
                "cuda error: out of memory", "failed to allocate")


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
    def load(cls, path: str) -> "Task":
        with open(path) as f:
            raw = json.load(f)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - fields
        if unknown:
            raise ValueError(f"{path}: unknown task keys {sorted(unknown)}; expected {sorted(fields)}")
        return cls(**raw)


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


def write_json(path: str, obj: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)


def worker_main(run_fn: Callable[[Task, str], dict[str, Any]], argv: list[str] | None = None) -> int:
    """Parse ``--task/--out``, call ``run_fn(task, out_json)``, write the result JSON.

    Every outcome is written as a result (exit code 0) so the harness can tell an OOM or a
    missing system from a crash; only a failure to write the result itself exits non-zero.
    """
    p = argparse.ArgumentParser()
    p.add_argument("--task", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    task = Task.load(args.task)
    base = {"system": task.system, "workload": task.workload, "kind": task.kind}
    try:
        result = run_fn(task, args.out)
        if task.kind == "train":
            validate_train_result(result, task.steps)
        out = {**base, "status": "ok", **result}
    except BaseException as exc:  # noqa: BLE001 - every outcome becomes a result
        if isinstance(exc, KeyboardInterrupt):
            raise
        status = classify_exception(exc)
        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        out = {**base, "status": status, "error": f"{type(exc).__name__}: {exc}"[:2000],
               "traceback_tail": tb[-4000:]}
    write_json(args.out, out)
    return 0
