"""Run metrics: `metrics.jsonl` (one JSON object per line), optional TensorBoard, loss-curve PNG.

Record kinds (every record has "step", the number of optimizer updates done):
  train:      {"step", "epoch", "loss", "learning_rate", "grad_norm", "num_tokens", "window_tokens",
               "step_seconds", "tokens_per_second", "peak_memory_gib" (GPU only)}
              loss = mean of the per-step losses since the previous train record (the window);
              num_tokens = non-padding tokens trained on since step 0 (cumulative, as TRL);
              window_tokens = those of the window; step_seconds / tokens_per_second = the window's training
              time (device sync to device sync, eval and checkpoints excluded) per step / per token;
              peak_memory_gib = the allocator's peak since the process started
              trainer dpo adds its means over the window (docs/objectives.md): "rewards/chosen", "rewards/rejected",
              "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected", "num_pairs"
  eval:       {"step", "eval_loss", "eval_tokens"}      eval_loss = summed CE / target count of the eval set
              (trainer dpo: the mean pair loss, "eval_num_pairs" in place of "eval_tokens", and "eval_rewards/*",
              "eval_logps/*": the train record's metrics over the eval set)
  samples:    {"step", "samples": [{"prompt", "completion"}]}   greedy completions of eval_generate_prompts
  checkpoint: {"step", "checkpoint": path}             written after the checkpoint is complete on disk
A value that is NaN or infinite is written as null (the file stays strict JSON); the run stops right after it.
On resume from step k, records with step > k (written by the interrupted run after its last checkpoint)
are dropped, so the file reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger("jaxft.train")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl (a torn last line from a killed run is skipped)."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class MetricsWriter:
    """Appends records to `<output_dir>/metrics.jsonl` (flushed per record) and to TensorBoard if available."""

    def __init__(self, output_dir: str | Path, *, resume_step: int | None = None, tensorboard: bool = True):
        self.path = Path(output_dir) / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
            os.replace(tmp, self.path)
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = _tensorboard_writer(Path(output_dir) / "tensorboard") if tensorboard else None

    def write(self, record: dict[str, Any]) -> None:
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")  # strict JSON: a NaN is written as null
        self._file.flush()
        if self._tb is not None:
            step = int(record["step"])
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    prefix = "eval" if key.startswith("eval_") else "train"
                    self._tb.add_scalar(f"{prefix}/{key.removeprefix('eval_')}", value, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _tensorboard_writer(logdir: Path):
    """tensorboardX's or torch's SummaryWriter when one is importable, else None (TensorBoard is optional)."""
    try:
        from tensorboardX import SummaryWriter  # type: ignore  # optional: TensorBoard logging only
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter  # type: ignore
        except Exception:  # torch missing, or torch without the tensorboard package
            return None
    return SummaryWriter(str(logdir))


def plot_loss_curve(records: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Train (and eval) loss against step as a PNG; None (with a logged note) when matplotlib is missing."""
    try:
        # Optional (the `demo` extra). The object API with an explicit Agg canvas: no pyplot, no process-wide
        # backend switch.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("matplotlib is not installed: skipping the loss-curve plot (pip install matplotlib)")
        return None
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", lw=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy per target token")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)
