#!/usr/bin/env python
"""jaxft worker of the training benchmark (scripts.bench.train): one process per session (one system, one model shape).

``run_jaxft`` runs the mode's recipe, ``examples/bench/<mode>.yaml`` (the file ``jaxft-train`` runs;
LoRA and AdamW as workloads.LORA / ADAMW), through ``jaxft.run.Run`` (the code path of
``jaxft-train``) on the random-weight HF model directory, and trains ``steps`` steps on
``make_token_data(workload, steps)``: step i trains on ``data.step(i)`` (the packed-batch dict,
batches on the device before the clock starts). ``Run.compile`` compiles the step once, ahead of the
clock; its ``memory_analysis()`` gives the static memory numbers below. Each step is timed with
block_until_ready on its loss. Exceptions propagate to worker_main: an out-of-memory (RESOURCE_EXHAUSTED) is recorded as "oom", anything else "error".

A DPO mode (`trainer: dpo`: examples/bench/dpo.yaml, system jaxft_dpo) trains a DPO workload: each row one whole
preference pair (workloads.Workload.dpo), the step the recipe's DPO objective, as `jaxft-train` runs a DPO recipe;
the row's extra.objective_metrics holds each step's rewards/* and logps/* (TRL's names).

Sessions (worker_common): consecutive tasks on the same model_dir (and the same dtype,
attention and remat settings) reuse the loaded frozen weights; LoRA starts each task from the same
seeded init (kept on the host, copied to the device per task), with a fresh optimizer state.

Peak memory: JAX cannot reset memory_stats()["peak_bytes_in_use"], so the harness orders a
shape's workloads by ascending expected memory, and a freshly loaded model's step is compiled from
its abstract shapes BEFORE the weights reach the device (XLA's autotuning scratch, on top of resident
weights, exceeded the 1B lean training peak on the H200). A task reads ``bytes_in_use`` and the process
peak just before its first step and the peak after its last. If the peak rose during the steps,
it is this task's training peak, exactly (peak_memory_source "allocator"); otherwise an earlier
task (or the load) set it, and the task reports the static estimate bytes_in_use_before +
temp + output - alias of the compiled step ("static_estimate").

Mixture-of-experts shapes record the grouped matmul of their experts in the row's settings: ``grouped_matmul`` is
the implementation that ran (kernels_pallas.grouped_matmul.implementation_for: "auto" resolved for the step's dtype
on this device), ``grouped_matmul_setting`` the recipe's ``grouped_matmul_implementation`` (JAXFT_BENCH_GMM=xla
runs the ragged_dot side of an A/B).

Profiling (optional): JAXFT_PROFILE_DIR=DIR profiles 3 extra steps of the workloads named in
JAXFT_PROFILE_WORKLOADS (default 8b_4096) in the modes named in JAXFT_PROFILE_MODES (default fast) and
dumps the optimized step HLO, so trace events map to jaxft's named scopes; the result's extra.profile
also holds `overlap` (profile.overlap_summary: host-copy time, per-layer backward time and how
much of the copies ran under compute). Each profiled mode writes its trace under DIR/<mode>. XLA reads XLA_FLAGS once per process, so the dump flags are set
at worker start, before JAX initialises, whenever any task of the session is profiled.

Compilation cache (optional): JAX_COMPILATION_CACHE_DIR=DIR (JAX's own setting, read from the environment, which
the harness passes to every worker) keeps each compiled step on disk, so a later process compiling the same step
(a later pass or a resumed session of one device call, the same recipe on a shape again) reads it instead of
compiling: `remat: auto`'s candidates included. The row's extra.compilation_cache_dir says whether it was set,
since compile_s is then a cache read; the peak statistics are unaffected (a read runs no autotuning).

Usage (the harness does this, from the repository root or with it on PYTHONPATH):
    python -m scripts.bench.jaxft_worker --task TASKS.json --out RESULTS.json
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import Any

from .workloads import Workload
from .worker_common import (BENCH_RECIPES, ModelCache, Task, jaxft_modes, load_tasks, trains_dpo, trains_in_full,
                            worker_main)


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Each mode is a jaxft-train recipe in examples/bench/ (settings chosen from the measurements in
# docs/benchmarks.md); the system name picks one (jaxft -> fast, jaxft_lean -> lean), JAXFT_BENCH_MODE
# overrides it for ablations:
#   fast: no rematerialisation (activations stay on the device: H200 memory is ample at these shapes), layers
#         unrolled over per-layer weight buffers (8B, 1x4096 on the H200: 273 ms/step vs 286 ms scanned, whose
#         per-layer weight slices are copies; docs/benchmarks.md);
#   lean: layer inputs offloaded to pinned host memory, everything else recomputed in the backward pass; the
#         layer scan (host offload of the scanned layer inputs is what keeps the memory down).
#   offload_attn (memory: balanced), lean_attn_host (memory: max_context), offload_unroll, auto, auto_40gb: the
#         remat policies of jaxft.memory.policy (one YAML each; auto_40gb = auto within 40 GB);
#   dpo: fast with DPO as the objective (`trainer: dpo`; the DPO workloads, whose rows hold whole preference pairs);
#   qlora: fast on a 4-bit base (the frozen linears, and a MoE shape's experts, quantised to bitsandbytes nf4
#         with double quantisation while loading); qlora_lean: the same base with full remat over the layer scan;
#         qlora_offload: the same base with the layer inputs offloaded from the unrolled loop.
MODES = jaxft_modes()  # one per examples/bench/<mode>.yaml
PROFILE_STEPS = 3


def mode_yaml(mode: str) -> str:
    return os.path.join(BENCH_RECIPES, f"{mode}.yaml")


def _profile_dir(workload_name: str, mode: str) -> str | None:
    wanted = os.environ.get("JAXFT_PROFILE_WORKLOADS", "8b_4096").split(",")
    modes = os.environ.get("JAXFT_PROFILE_MODES", "fast").split(",")
    root = os.environ.get("JAXFT_PROFILE_DIR")
    return os.path.join(root, mode) if root and workload_name in wanted and mode in modes else None


def setup_profiling(tasks: list[Task]) -> None:
    """Set the HLO dump flags before JAX starts, if any task of the session will be profiled."""
    dirs = {_profile_dir(t.workload, _mode(t)) for t in tasks if t.kind == "train"} - {None}
    if not dirs:
        return
    profile_dir = dirs.pop()  # one process per system: one mode, one directory
    os.makedirs(profile_dir, exist_ok=True)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={profile_dir}/hlo"
                               " --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*"
                               # CUDA-graph command buffers hide which HLO op ran a kernel (the first
                               # profile on the H200 attributed most kernels to command_buffer_N), but
                               # turning them off would change the timed steps of this same process:
                               # JAXFT_PROFILE_XLA_FLAGS="--xla_gpu_enable_command_buffer=" in a
                               # profile-only run gives per-scope attribution.
                               " " + os.environ.get("JAXFT_PROFILE_XLA_FLAGS", "")).strip()


def system_mode(system: str) -> str:
    """System "jaxft" = the fast mode; "jaxft_<mode>" = examples/bench/<mode>.yaml (jaxft_lean = lean)."""
    mode = "fast" if system == "jaxft" else system.removeprefix("jaxft_")
    if mode not in MODES:
        raise ValueError(f"system {system!r} names no jaxft mode; modes: {', '.join(MODES)}")
    return mode


def _mode(task: Task) -> str:
    return os.environ.get("JAXFT_BENCH_MODE", system_mode(task.system))


def mode_config(mode: str, model_dir: str, workload: Workload, dtype: str, extra: tuple[str, ...] = ()):
    """The TrainConfig of `examples/bench/<mode>.yaml` for this workload's model, batch and length (plus
    JAXFT_BENCH_REMAT / _ATTENTION / _LAYERS / _GMM overrides for ablations; _GMM: the MoE grouped matmul, e.g.
    xla for the ragged_dot side of an A/B; then `extra`, `key=value` overrides such as a mesh): what `jaxft-train`
    would run."""
    from jaxft.train import load_config

    dpo = trains_dpo(mode)
    if dpo != workload.dpo:
        raise ValueError(f"mode {mode!r} trains {'DPO' if dpo else 'SFT'} and workload {workload.name!r} is "
                         f"{'a DPO' if workload.dpo else 'an SFT'} workload: pair DPO modes with DPO workloads")
    data = "preference.jsonl" if dpo else "train.jsonl"  # (the recipe's data is never read: the workload's is)
    overrides = [f"model_name_or_path={model_dir}", f"dataset={os.path.join(REPO, 'examples/data', data)}",
                 f"max_seq_length={workload.row_len}", f"per_device_train_batch_size={workload.batch}",
                 f"bf16={'true' if dtype == 'bfloat16' else 'false'}"]
    if not trains_in_full(mode):  # a full fine-tune refuses LoRA keys
        overrides += lora_overrides(workload)
    for env, key in (("REMAT", "remat"), ("ATTENTION", "attention_implementation"), ("LAYERS", "layer_loop"),
                     ("GMM", "grouped_matmul_implementation")):
        if os.environ.get(f"JAXFT_BENCH_{env}"):
            overrides.append(f"{key}={os.environ[f'JAXFT_BENCH_{env}']}")
    # attention "auto" is the reference off the GPU (kernels_pallas.attention.config.choose_implementation)
    return load_config(mode_yaml(mode), overrides + list(extra))


def lora_overrides(workload: Workload) -> list[str]:
    """The recipe's LoRA keys for the shapes where the peers' LoRA differs from q..down linears: a MoE shape
    adapts its attention linears and, as expert LoRA, the fused expert parameters (PEFT's target_parameters,
    as hf_ckpt and unsloth train);
    a vision-language shape adapts the language model's linears only (finetune_vision_layers: false replaces
    lora_target_modules, which must then be all-linear: the language layers' q..down, never the merger)."""
    from .workloads import LORA, lora_module_targets, moe_layout

    out = []
    if moe_layout(workload.shape) is not None:  # workloads.lora_module_targets says why attention only
        out.append(f"lora_target_modules=[{', '.join(lora_module_targets(workload.shape))}]")
        out.append(f"lora_target_parameters=[{', '.join(LORA.expert_targets)}]")
    if workload.shape.is_vlm:
        out += ["lora_target_modules=all-linear", "finetune_vision_layers=false"]
    return out


def run_dtype(workload: Workload) -> str:
    """The weights' dtype a jaxft bench run trains in: bf16, but float32 for a tiny shape on a CPU (the CPU tests'
    losses then compare with fp32 torch)."""
    import jax

    return "float32" if workload.tiny and jax.devices()[0].platform == "cpu" else "bfloat16"


def run_jaxft(workload: Workload, model_dir: str, steps: int, mode: str = "fast",
              cache: ModelCache | None = None) -> dict[str, Any]:
    """Train ``workload`` with jaxft for ``steps`` steps and return the raw measurements."""
    import jax

    import jaxft
    from jaxft.run import Run

    from .workloads import make_token_data

    cache = cache if cache is not None else ModelCache()
    profile_dir = _profile_dir(workload.name, mode)
    device = jax.devices()[0]
    dtype = run_dtype(workload)
    config = mode_config(mode, model_dir, workload, dtype)
    data = make_token_data(workload, steps)
    host_batches = [data.step(i) for i in range(steps)]

    key = (model_dir, config.model.bf16, config.execution_config)
    compile_s, fresh = None, None
    if not cache.holds(key):
        # A fresh load: compile BEFORE the weights are on the device, from the shapes alone. XLA's
        # autotuning allocates scratch buffers while it compiles; with the weights resident that transient
        # can exceed the training peak (1B lean: 4.23 GB before the first step vs 3.69 GB in the steps), and
        # the allocator's peak cannot be reset, so the steps' own peak would be hidden behind it.
        cache.clear()
        fresh = Run.from_config(config, total_steps=steps)
        fresh.compile(host_batches[0])
        compile_s = fresh.compile_seconds
    t0 = time.perf_counter()

    def load():
        fresh.load()
        # Every task starts from this host copy of the seed-0 LoRA init (each step donates its input).
        return fresh, jax.device_get(fresh.lora)

    (run, lora_init), reused = cache.get(key, load)
    load_s = time.perf_counter() - t0
    run.set_state(lora_init)  # a fresh optimizer state, made after the old state is released
    batches = [jax.device_put(b) for b in host_batches]  # on the device before the clock starts
    jax.block_until_ready((run.lora, run.opt_state, batches))
    if compile_s is None:  # a reused model: the weights are resident anyway
        run.compile(host_batches[0])
        compile_s = run.compile_seconds
    run.fit_allocator(host_batches[0])  # as jaxft-train does: the temp must fit beside the load's pool
    analysis = run.memory_analysis()
    before = device.memory_stats() or {}  # None on CPU
    # What the device holds beside the step's arguments, read before the steps (after them, the donated buffers
    # have been replaced and the comparison would mix two states).
    outside = resident_outside((run.frozen, run.lora, run.opt_state, batches), device)
    if before:
        # XLA allocates the step's temp as one buffer: where the allocator's pool (its regions, which can exceed the
        # bytes in use) leaves less than that below its limit, the first step runs out of memory. One line before
        # the steps, so a failed row's log says by how much.
        gib = 2**30
        print(f"[jaxft] device memory before the steps: in use {before.get('bytes_in_use', 0) / gib:.2f} GiB, pool "
              f"{before.get('pool_bytes', 0) / gib:.2f} GiB, largest free block "
              f"{before.get('largest_free_block_bytes', 0) / gib:.2f} GiB, limit {before.get('bytes_limit', 0) / gib:.2f} "
              f"GiB; the step's temp {analysis.get('temp_size_in_bytes', 0) / gib:.2f} GiB", flush=True)
    times, losses, objective_metrics = [], [], []
    for i in range(steps):
        t0 = time.perf_counter()
        metrics = run.step(batches[i], i)
        loss = float(jax.block_until_ready(metrics["loss"]))
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if run.objective is not None:  # DPO's rewards/*, logps/*: scalars, fetched after the clock
            objective_metrics.append({k: v for k, v in metrics.items() if "/" in k})
    after = device.memory_stats() or {}
    peak, source, memory = _task_peak(before, after, analysis)
    extra = {"memory": memory, "memory_analysis": analysis, "compile_s": compile_s, "model_load_s": load_s,
             "memory_bytes": _memory_breakdown(run.frozen, run.lora, run.opt_state, batches, peak),
             "resident_outside_state": outside,
             "recipe": os.path.relpath(mode_yaml(mode), REPO),
             # compile_s is a cache read, not a compile, when an earlier process compiled the same step
             "compilation_cache_dir": jax.config.jax_compilation_cache_dir}
    if objective_metrics:  # per step, TRL's names (jaxft.train.dpo.METRICS)
        extra["objective_metrics"] = [{k: float(v) for k, v in m.items()} for m in jax.device_get(objective_metrics)]
    if run.trials.compiles:  # remat "auto": what it compiled, [policy, remat_layers, depth] (a shallow depth: a probe)
        extra["remat_compiles"] = [list(c) for c in run.trials.compiles]
    if profile_dir:
        extra.update(_profile(profile_dir, run, batches, run.model_config.num_layers))
    execution = run.execution  # as run: `remat: auto` resolved (policy, remat_layers, hence the layer loop)
    return {
        "step_times_s": times,
        "losses": losses,
        "peak_memory_bytes": peak,
        "peak_memory_source": source,
        "data_sha256": data.sha256,
        "base_model_reused": reused,
        "lora_param_dtype": str(jax.tree.leaves(run.lora)[0].dtype),
        "trainable_params": int(sum(x.size for x in jax.tree.leaves(run.lora))),
        "device_name": str(device.device_kind),
        "versions": {"jax": jax.__version__, "jaxft": getattr(jaxft, "__version__", "dev")},
        "settings": {"mode": mode, "recipe": extra["recipe"], "remat": execution.remat,
                     "remat_layers": execution.remat_layers, "remat_block": execution.remat_block,
                     "max_memory_gb": execution.max_memory_gb, "remat_estimates": run.trials.estimates,
                     "attention": execution.attention_implementation, "layers": run.layer_loop,
                     "ce_chunk_size": execution.ce_chunk_size, "dtype": dtype, "lora_dtype": "float32",
                     "compute": dtype, **grouped_matmul_settings(workload, execution, dtype),
                     **({"objective": dataclasses.asdict(run.objective)} if run.objective is not None else {})},
        "extra": extra,
    }


def grouped_matmul_settings(workload: Workload, execution, dtype: str) -> dict[str, Any]:
    """A MoE shape's grouped matmul: the setting (`grouped_matmul_implementation`) and the implementation that
    ran for the step's dtype on this device ("auto" resolved: pallas_mosaic on Hopper in bf16, else xla); {} for
    a dense shape (no grouped matmul)."""
    from kernels_pallas.grouped_matmul import implementation_for

    from .workloads import moe_layout

    if moe_layout(workload.shape) is None:
        return {}
    setting = execution.grouped_matmul_implementation
    return {"grouped_matmul_setting": setting, "grouped_matmul": implementation_for(setting, dtype)}


def _task_peak(before: dict[str, int], after: dict[str, int],
               analysis: dict[str, int]) -> tuple[int, str, dict[str, int]]:
    """(peak bytes, source, the numbers it came from) of the timed steps; see the module docstring."""
    in_use = int(before.get("bytes_in_use", 0))
    peak_before, peak_after = int(before.get("peak_bytes_in_use", 0)), int(after.get("peak_bytes_in_use", 0))
    estimate = in_use + analysis.get("temp_size_in_bytes", 0) + analysis.get("output_size_in_bytes", 0) \
        - analysis.get("alias_size_in_bytes", 0)
    numbers = {"bytes_in_use_before_steps": in_use, "process_peak_before_steps": peak_before,
               "process_peak_after_steps": peak_after, "static_estimate": int(estimate),
               # the allocator's regions and limit (what a one-buffer temp must fit beside)
               "pool_bytes_before_steps": int(before.get("pool_bytes", 0)),
               "bytes_limit": int(before.get("bytes_limit", 0))}
    if peak_after > peak_before:  # the allocator's maximum was reached during these steps
        return peak_after, "allocator", numbers
    return int(estimate), "static_estimate", numbers


def _profile(profile_dir: str, run, batches, num_layers: int) -> dict[str, Any]:
    """A few more steps under jax.profiler, summarised by jaxft's named scopes (after the timed steps)."""
    import jax

    from .profile import load_step_hlo, load_trace, overlap_summary, summarize_trace

    try:  # the timings are the result; a profiler failure must not lose them
        t0 = time.perf_counter()
        with jax.profiler.trace(profile_dir):
            for i in range(PROFILE_STEPS):
                metrics = run.step(batches[i % len(batches)], i)
            jax.block_until_ready(metrics["loss"])
        wall = time.perf_counter() - t0
        # The dump holds only this worker's step modules compiled so far: the profiled task's is the largest.
        trace, hlo = load_trace(profile_dir), load_step_hlo(f"{profile_dir}/hlo")
        summary = summarize_trace(trace, hlo, PROFILE_STEPS, wall)
        summary["overlap"] = overlap_summary(trace, hlo, PROFILE_STEPS, num_layers)
        return {"profile": summary}
    except Exception as e:  # noqa: BLE001 - recorded in the result
        return {"profile_error": f"{type(e).__name__}: {str(e)[:1000]}"}


def _memory_breakdown(frozen, lora, opt_state, batches, peak: int) -> dict[str, int]:
    """This task's peak split into what is resident by construction and the rest (activations, saved
    residuals, cross-entropy chunks, workspace)."""
    import jax

    def nbytes(tree):
        return int(sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes")))

    parts = {"frozen_weights": nbytes(frozen), "lora_params": nbytes(lora), "optimizer_state": nbytes(opt_state),
             "batches": nbytes(batches)}
    parts["activations_and_workspace"] = max(peak - sum(parts.values()), 0)
    parts["peak"] = peak
    parts["frozen_quantized_weights"] = quantized_bytes(frozen)  # the part of frozen_weights in 4 or 8 bits
    return parts


def distinct_buffers(arrays) -> dict[int, Any]:
    """{device buffer address: one array on it} of `arrays`. Why by buffer, not by Python object: two Array objects
    can share one buffer (a `device_put` of an uncommitted array onto its own device wraps the same buffer), and
    flax's Variables keep replaced objects alive in reference cycles until a garbage collection (Qwen3-30B-A3B's
    optimizer moments were counted twice by object). Deleted (donated) and
    multi-device arrays are left out."""
    seen: dict[int, Any] = {}
    for x in arrays:
        try:
            seen[x.unsafe_buffer_pointer()] = x
        except Exception:  # noqa: BLE001 - deleted, or not on one device: no single buffer to name
            continue
    return seen


def resident_outside(state, device=None, top: int = 8) -> dict[str, Any]:
    """The device buffers alive beside the run's `state` (weights, LoRA, optimizer, batches): their total bytes and
    the `top` largest (shape, dtype, bytes); with a `device`, its bytes in use against the state's bytes, before
    and after a garbage collection (unreachable cycles that still hold buffers). Why: Qwen3-30B-A3B's row held
    2.74 GB before its first step beyond its step's arguments, which the peak then
    counts."""
    import gc

    import jax

    held = distinct_buffers(jax.tree.leaves(state))
    others = sorted((x for p, x in distinct_buffers(jax.live_arrays()).items() if p not in held),
                    key=lambda x: -x.nbytes)
    found = {"bytes": int(sum(x.nbytes for x in others)),
             "largest": [[list(x.shape), str(x.dtype), int(x.nbytes)] for x in others[:top]]}
    stats = device.memory_stats() if device is not None else None
    if stats:  # None on CPU
        state_bytes = int(sum(x.nbytes for x in held.values()))
        found["state_bytes"] = state_bytes
        found["in_use_beyond_state"] = int(stats.get("bytes_in_use", 0)) - state_bytes
        gc.collect()
        found["in_use_beyond_state_after_gc"] = int((device.memory_stats() or {}).get("bytes_in_use", 0)) - state_bytes
    return found


def quantized_bytes(frozen) -> int:
    """Bytes of the quantised storage (`QuantizedWeight`, 4-bit or FP8: linears and MoE experts, codes and scales) in
    `frozen`."""
    import jax
    from flax import nnx

    from jaxft.models import QuantizedWeight

    quantized = [v for _, v in nnx.to_flat_state(frozen) if isinstance(v, QuantizedWeight)]
    # A Variable is a pytree of its value (one stacked array, or the per-layer arrays of the unrolled loop).
    return int(sum(x.nbytes for x in jax.tree.leaves(quantized) if hasattr(x, "nbytes")))


def _run_task(task: Task, out_json: str, cache: ModelCache) -> dict[str, Any]:
    if task.kind != "train":
        raise ValueError(f"scripts.bench.jaxft_worker handles only kind='train' tasks, got {task.kind!r}")
    return run_jaxft(task.workload_obj, task.model_dir, task.steps, mode=_mode(task), cache=cache)


if __name__ == "__main__":
    # remat auto's lines (the budget, every candidate's estimate, the choice) go to the session's log: a row that
    # fails (out of memory, say) records no settings, and these lines are then all that says what ran and why.
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("jaxft.run").setLevel(logging.INFO)
    if "--task" in sys.argv:  # before worker_main imports JAX's backend (XLA_FLAGS is read once)
        setup_profiling(load_tasks(sys.argv[sys.argv.index("--task") + 1])[0])
    from jaxft import claim_gpu_memory  # (imports JAX: after the flags above)

    claim_gpu_memory()  # the GPU share jaxft-train takes (jaxft.train.train does the same), read once too
    sys.exit(worker_main(_run_task))
