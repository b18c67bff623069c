"""Honest throughput: training time measured from device sync to device sync.

JAX dispatches work asynchronously: `step_fn(...)` returns as soon as the step is queued, so a clock read
right after the last step of a window measures how fast the host *queued* work, not how fast the device did
it (on CPU the logged speed was up to 200x the real one). `WindowMeter` therefore reads the clock only after
the window's metrics are on the host (the last step's metrics depend on every earlier step through the LoRA
state, so fetching them waits for all queued work). Time spent in evaluation and checkpointing is excluded
the same way: the meter syncs on the training state *before* the pause starts, so queued training work is
counted as training, and resumes the clock when the pause ends.

Compilation is kept out of every window: the loop compiles the step ahead of time and reports its time on
its own line (`RunSummary.compile_seconds`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any, Callable, Iterator

import jax


def device_peak_bytes() -> int | None:
    """The allocator's peak bytes in use since the process started, max over local devices; None where the
    platform keeps no allocator statistics (the CPU)."""
    peaks = []
    for device in jax.local_devices():
        stats = device.memory_stats()
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


@dataclasses.dataclass(frozen=True)
class Window:
    """One logging window: `steps` optimizer steps, `tokens` non-padding tokens, `seconds` of training
    (sync to sync, pauses excluded)."""

    steps: int
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def step_seconds(self) -> float:
        return self.seconds / max(self.steps, 1)


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """What a run cost. Medians are over logging windows; `peak_memory_bytes` is the allocator peak (None on
    CPU); `wall_seconds` covers the whole `train()` call (loading, compiling, training, exports)."""

    steps: int
    num_tokens: int
    median_tokens_per_second: float | None
    median_step_seconds: float | None
    training_seconds: float
    compile_seconds: float
    peak_memory_bytes: int | None
    wall_seconds: float

    def line(self) -> str:
        parts = [f"{self.steps} steps, {self.num_tokens:,} tokens in {self.wall_seconds:.1f} s wall "
                 f"({self.training_seconds:.1f} s training, {self.compile_seconds:.1f} s compiling)"]
        if self.median_tokens_per_second is not None:
            parts.append(f"median {self.median_tokens_per_second:,.0f} tokens/s, "
                         f"{self.median_step_seconds:.3f} s/step")
        if self.peak_memory_bytes is not None:
            parts.append(f"peak device memory {self.peak_memory_bytes / 2**30:.2f} GiB")
        return "; ".join(parts)


class WindowMeter:
    """Training time of logging windows, from sync to sync, with pauses (eval, checkpoints) excluded."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._start: float | None = None
        self._excluded = 0.0
        self.windows: list[Window] = []

    def start(self) -> None:
        """Starts a window. Call when nothing is queued on the device (after a sync)."""
        self._start, self._excluded = self._clock(), 0.0

    def close(self, metrics: list[Any], tokens: int) -> tuple[list[Any], Window]:
        """Fetches the window's metrics (the sync), then reads the clock. Returns (host metrics, window) and
        starts the next window."""
        host = jax.device_get(metrics)
        now = self._clock()
        window = Window(steps=len(metrics), tokens=tokens, seconds=now - self._start - self._excluded)
        self.windows.append(window)
        self._start, self._excluded = now, 0.0
        return host, window

    @contextlib.contextmanager
    def paused(self, state: Any) -> Iterator[None]:
        """Excludes the enclosed work from the window; `state` (e.g. the LoRA state) is synced on first, so
        training work still queued is counted as training."""
        jax.block_until_ready(state)
        began = self._clock()
        try:
            yield
        finally:
            self._excluded += self._clock() - began

    @property
    def training_seconds(self) -> float:
        return sum(w.seconds for w in self.windows)

    def medians(self) -> tuple[float | None, float | None]:
        """(median tokens/s, median s/step) over the windows, or (None, None) before the first window."""
        if not self.windows:
            return None, None
        return (statistics.median(w.tokens_per_second for w in self.windows),
                statistics.median(w.step_seconds for w in self.windows))
