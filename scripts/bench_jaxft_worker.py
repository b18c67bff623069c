#!/usr/bin/env python
"""jaxft worker of scripts/bench_train.py: one process per workload.

THE HOOK: ``run_jaxft`` below is a placeholder owned by the jaxft lead. Until it is filled, the
harness reports the system as "not_run" (the NotImplementedError is caught by worker_main).

What run_jaxft(workload, model_dir, steps, out_json) must do:
  * load the random-weight HF model directory ``model_dir`` (bf16 safetensors + config.json in
    transformers 5 format: ``rope_parameters``, not ``rope_scaling``) with jaxft's best settings;
  * add LoRA per bench.workloads.LORA (r=16, alpha=32, dropout 0, q,k,v,o,gate,up,down; fp32);
  * train ``steps`` steps with bench.workloads.ADAMW (AdamW lr 1e-4, b1 0.9, b2 0.999, eps 1e-8,
    weight_decay 0.0 -- optax.adamw's default is 1e-4, pass 0.0) on
    ``data = bench.workloads.make_token_data(workload, steps)``: step i trains on
    ``data.step(i)`` (the jaxft packed-batch dict: input_ids, targets, loss_mask, segment_ids,
    positions, each [B, T]); the loss is the mean over loss_mask == 1 tokens (what HF computes);
    put the batches on the device before timing;
  * time every step (steps including the compile: the harness drops the first --warmup ones)
    with the device synchronised at its end (block_until_ready on the loss/params);
  * return a dict (worker_main validates it and writes it to ``out_json``; ``out_json``'s
    folder may be used for scratch files) with at least
        "step_times_s":      list[float] of length steps,
        "losses":            list[float] of length steps (loss computed by each step),
        "peak_memory_bytes": int, jax.devices()[0].memory_stats()["peak_bytes_in_use"],
        "data_sha256":       data.sha256,
    and ideally "lora_param_dtype" (str), "trainable_params" (int), "device_name" (str),
    "versions" (dict), "settings" (dict: remat policy, kernels, ... = "its best settings").
  * let exceptions propagate: an out-of-memory (XlaRuntimeError RESOURCE_EXHAUSTED) is recorded
    as status "oom", anything else as "error".
"""

from __future__ import annotations

import sys
from typing import Any

from bench.workloads import Workload
from bench.worker_common import Task, worker_main


# "Best settings" per mode, chosen from the measurements in docs/benchmarks.md. The system name picks one
# (jaxft -> fast, jaxft_lean -> lean); JAXFT_BENCH_MODE overrides it for ablations:
#   fast: no rematerialisation (activations stay on the device: H200 memory is ample at these shapes);
#   lean: layer inputs offloaded to pinned host memory, everything else recomputed in the backward pass.
MODES = {
    "fast": dict(remat="none", attention="auto", ce_chunk_size=None),
    "lean": dict(remat="offload", attention="auto", ce_chunk_size=256),  # smaller live logits chunk
    "full_remat": dict(remat="full", attention="auto", ce_chunk_size=None),
}


def run_jaxft(workload: Workload, model_dir: str, steps: int, out_json: str, mode: str = "fast") -> dict[str, Any]:
    """Train ``workload`` with jaxft for ``steps`` steps and return the raw measurements."""
    import os
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxft
    from bench.workloads import ADAMW, LORA, make_token_data
    from jaxft.lora import LoraConfig, apply_lora
    from jaxft.train.step import make_optimizer, make_train_step, split_model

    mode = os.environ.get("JAXFT_BENCH_MODE", mode)
    profile_dir = os.environ.get("JAXFT_PROFILE_DIR") if workload.name in os.environ.get(
        "JAXFT_PROFILE_WORKLOADS", "8b_4096").split(",") and mode == "fast" else None
    if profile_dir:  # dump the optimized HLO so trace events can be mapped to jaxft's named scopes
        os.makedirs(profile_dir, exist_ok=True)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={profile_dir}/hlo"
                                   " --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*"
                                   # CUDA-graph command buffers hide which HLO op ran a kernel (the first
                                   # profile on the H200 attributed most kernels to command_buffer_N), but
                                   # turning them off would change the timed steps of this same process:
                                   # JAXFT_PROFILE_XLA_FLAGS="--xla_gpu_enable_command_buffer=" in a
                                   # profile-only run gives per-scope attribution.
                                   " " + os.environ.get("JAXFT_PROFILE_XLA_FLAGS", "")).strip()
    settings = dict(MODES[mode], mode=mode)
    for key in ("remat", "attention"):  # explicit overrides for ablations
        if os.environ.get(f"JAXFT_BENCH_{key.upper()}"):
            settings[key] = os.environ[f"JAXFT_BENCH_{key.upper()}"]
    dtype = "float32" if workload.tiny and jax.devices()[0].platform == "cpu" else "bfloat16"
    attention = settings["attention"]
    if jax.devices()[0].platform == "cpu":
        attention = "xla"
    model = jaxft.from_pretrained(model_dir, dtype=dtype, attention_impl=attention, remat=settings["remat"])
    model = apply_lora(model, LoraConfig(r=LORA.r, alpha=LORA.alpha, dropout=LORA.dropout,
                                         target_modules=tuple(LORA.targets)), seed=0)
    graphdef, lora, frozen = split_model(model)
    del model
    optimizer = make_optimizer(ADAMW.lr, b1=ADAMW.b1, b2=ADAMW.b2, eps=ADAMW.eps, weight_decay=ADAMW.weight_decay)
    opt_state = optimizer.init(lora)
    step_fn = make_train_step(graphdef, optimizer, ce_chunk_size=settings["ce_chunk_size"])
    data = make_token_data(workload, steps)
    batches = [jax.device_put({k: np.asarray(v)[None] for k, v in data.step(i).items()}) for i in range(steps)]
    jax.block_until_ready(batches)
    rng = jax.random.key(0)
    times, losses = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        lora, opt_state, metrics = step_fn(lora, opt_state, frozen, batches[i], rng)
        loss = float(jax.block_until_ready(metrics["loss"]))
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    stats = jax.devices()[0].memory_stats() or {}
    extra = {"memory_bytes": _memory_breakdown(frozen, lora, opt_state, batches, stats)}
    if profile_dir:
        from bench.profile import load_step_hlo, load_trace, summarize_trace

        n = 3
        try:  # the timings above are the result; a profiler failure must not lose them
            t0 = time.perf_counter()
            with jax.profiler.trace(profile_dir):
                for i in range(n):
                    lora, opt_state, metrics = step_fn(lora, opt_state, frozen, batches[i % steps], rng)
                jax.block_until_ready(metrics["loss"])
            wall = time.perf_counter() - t0
            extra["profile"] = summarize_trace(load_trace(profile_dir), load_step_hlo(f"{profile_dir}/hlo"), n,
                                               wall)
        except Exception as e:  # noqa: BLE001 - recorded in the result
            extra["profile_error"] = f"{type(e).__name__}: {str(e)[:1000]}"
    return {
        "step_times_s": times,
        "losses": losses,
        "peak_memory_bytes": int(stats.get("peak_bytes_in_use", 0)),
        "data_sha256": data.sha256,
        "lora_param_dtype": str(jax.tree.leaves(lora)[0].dtype),
        "trainable_params": int(sum(x.size for x in jax.tree.leaves(lora))),
        "device_name": str(jax.devices()[0].device_kind),
        "versions": {"jax": jax.__version__, "jaxft": getattr(jaxft, "__version__", "dev")},
        "settings": {**settings, "attention_resolved": attention, "dtype": dtype,
                     "lora_dtype": "float32", "compute": dtype},
        "extra": extra,
    }


def _memory_breakdown(frozen, lora, opt_state, batches, stats) -> dict[str, int]:
    """Peak device memory split into what is resident by construction and the rest (activations, saved
    residuals, cross-entropy chunks, workspace)."""
    import jax

    def nbytes(tree):
        return int(sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes")))

    parts = {"frozen_weights": nbytes(frozen), "lora_params": nbytes(lora), "optimizer_state": nbytes(opt_state),
             "batches": nbytes(batches)}
    peak = int(stats.get("peak_bytes_in_use", 0))
    parts["activations_and_workspace"] = max(peak - sum(parts.values()), 0)
    parts["peak"] = peak
    return parts


def _run_task(task: Task, out_json: str) -> dict[str, Any]:
    if task.kind != "train":
        raise ValueError(f"bench_jaxft_worker handles only kind='train' tasks, got {task.kind!r}")
    # System "jaxft" = fastest settings; "jaxft_lean" = host-offloaded rematerialisation (least memory).
    mode = "lean" if task.system == "jaxft_lean" else "fast"
    return run_jaxft(task.workload_obj, task.model_dir, task.steps, out_json, mode=mode)


if __name__ == "__main__":
    sys.exit(worker_main(_run_task))
