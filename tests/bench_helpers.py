"""Helpers of the benchmark scoreboard's tests (test_bench_train.py, test_bench_sessions.py)."""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def frozen_heap():
    """The workers collect garbage around every task (`worker_common.release_memory`, `ModelCache.clear`, jaxft's
    `Run.set_state`, accelerate's `free_memory` under TRL); over a test process's heap (torch, transformers and JAX
    imported) each collection costs ~1 s. Frozen, a collection walks only what was allocated since: the objects a
    task left behind, which it still frees."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
