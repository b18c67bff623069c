#!/usr/bin/env python
"""Max context: the longest single row (batch 1) each remat policy can train on this device, from the compiled
step's memory analysis plus host-memory accounting, then one real step at the goal length.

    PYTHONPATH=.:scripts python scripts/max_context.py [--model llama-3.1-8b] [--policies none,full,...]
        [--host-memory-gb 128] [--device-memory-gb G] [--deadline-s 300] [--out max_context.jsonl] [--md t.md]

The step is the benchmark's (`examples/bench/auto.yaml`: LoRA r16 alpha 32 on q..down, AdamW; bf16; attention
"auto") run through `jaxft.run.Run`, with remat set to the policy, the layer loop as `layer_loop: auto` picks it
(the scan under remat, unrolled without), the cross-entropy chunk by length (`ExecutionConfig.resolved_ce_chunk`)
and, for rows longer than `--mlp-chunk-size` (8192), the MLP in chunks of that many tokens (`mlp_chunk_size`: one
layer never holds [T, intermediate] activations). A length T fits when

    device: arguments + outputs + temporaries - aliased + allocator slack (`jaxft.auto.peak_estimate` of
            `Run.compile` from shapes,
            before any weight exists) <= the device budget (free memory less max(1 GiB, 5%), or --device-memory-gb)
    host:   the offloaded residuals (`jaxft.remat.residual_bytes` of the policy's offloaded names x layers, or what
            the compiled program reports in host memory if more) <= the host budget (--host-memory-gb, default the
            machine's memory, less max(8 GiB, 10%) for the process itself).

Search (`search_max`): both sides grow with T, so the fitting lengths are a prefix. The first probe is an analytic
guess (weights + the policy's per-token residuals from `residual_bytes`), then secant steps on the compiled
estimate (it is close to affine in T), clamped inside the bracket (largest fitting, smallest failing length),
until the bracket is one granule (--granularity, 1024) wide, the probe count is spent or the deadline is near.
Each probe is one compile (no weights, no run), with XLA's autotuning off on the GPU (--probe-autotune-level 0:
a long-row compile otherwise times every GEMM at full size); the real step compiles with autotuning.
Policies run in parallel worker processes (--jobs), one compile each at a time.

`offload_nested` is remat offload in nested blocks sized to the host budget (`remat_block: auto`, jaxft.remat):
the host holds one layer input per block, so its row is limited by the device (k layer inputs and one block's
recompute). Its load falls where a longer row takes a larger block, hence the search's frontier secant.

`--deviceless` compiles every probe for the H200 target description on a machine without a GPU
(scripts/deviceless/gpu_compile.py): no real step, no autotuning, Pallas attention (cuDNN does not lower there).
Measured against the GPU's own search (docs/benchmarks.md section 29) it gives 9-17% longer rows for the
device-limited policies: a planning number, not a measurement.

`auto` is not searched: it takes the first of `jaxft.remat.AUTO_ORDER` that fits the device and the host
(`jaxft.run.Run._host_fit`), and runs offload in nested blocks where offload's layer inputs exceed the host, so its
longest row is the longest of its candidates' (offload's: the longer of `offload` and `offload_nested`), and the
row says which candidate it would choose there (`auto_row`).

The real step (`--step-policy`, default offload, at `--step-seq`, default 262144, in its own process, started
beside the searches so the call ends in time): random weights made on the device (`Run.init_random`), one
forward + backward + AdamW update; step time, the allocator's peak, the process's peak RSS (pinned host buffers
included). `--step-seq max` waits for the searches and steps at the step policy's longest row instead.

Unsloth runs in torch, so its longest row cannot come from this method. Its column is DERIVED, not measured:
a least-squares line through its measured peaks (issue #10, H200, commit aa868ab: 19.72 / 23.9 / 32.3 GiB at
16k / 32k / 64k tokens, about 0.26 GiB per 1k tokens), solved for the device budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

GIB = 2**30
POLICIES = ("none", "full", "offload", "offload+attn", "lean_attn", "offload_all", "offload_nested")
# Policies of this script that are a remat policy plus execution settings: "offload_nested" is remat offload with
# nested blocks sized to the host budget (`remat_block: auto`, jaxft.remat); "lean_attn" names the selective policy
# `jaxft.remat.LEAN_ATTN` (`--policies` is split on commas; this module imports no JAX before the device is set up).
REMAT_OF = {"offload_nested": ("offload", {"remat_block": "auto"}),
            "lean_attn": ("offload=layer_input,attn_out,attn_lse", {})}
RECIPE = ROOT / "examples" / "bench" / "auto.yaml"
# Unsloth's measured peaks (tokens, GiB), 8B shape, batch 1, LoRA r16 all linear, H200 (issue #10's table).
UNSLOTH_POINTS = ((16384, 19.72), (32768, 23.9), (65536, 32.3))


# ------------------------------------------------------------------------------------------- the search
@dataclasses.dataclass
class SearchResult:
    """`best`: the longest probed length that fits (None: none did); `first_failing`: the shortest probed length
    that does not (None: none failed); `exact`: the two are one granule apart, or `best` is the cap."""

    best: int | None
    first_failing: int | None
    exact: bool
    probes: list[tuple[int, float]]
    stopped: str


def _floor(t: float, g: int) -> int:
    return int(math.floor(t / g)) * g


def search_max(load: Callable[[int], float], start: int, granularity: int, *, t_min: int, t_max: int,
               max_probes: int = 8, should_stop: Callable[[], bool] | None = None,
               slope: float | None = None) -> SearchResult:
    """The largest multiple T of `granularity` in [t_min, t_max] with load(T) <= 1, for a load that does not
    decrease with T (a probe that raised may return math.inf). `slope` (load per token) guides the step after
    the first probe; afterwards secant steps through the two probes nearest the boundary. Stops when the bracket
    is one granule wide, at `max_probes`, or when `should_stop()` says so before a probe (a deadline)."""
    g = granularity
    t_min, t_max = -(-t_min // g) * g, _floor(t_max, g)
    if t_min > t_max:
        raise ValueError(f"search_max: no multiple of {g} in [{t_min}, {t_max}]")
    points: dict[int, float] = {}
    lo = hi = None
    t = min(max(_floor(start, g), t_min), t_max)
    stopped, crept, sides = "probes", False, []
    while len(points) < max_probes:
        if should_stop is not None and should_stop():
            stopped = "deadline"
            break
        points[t] = value = load(t)
        if value <= 1.0:
            lo = t if lo is None else max(lo, t)
        else:
            hi = t if hi is None else min(hi, t)
        if lo is not None and (lo >= t_max or (hi is not None and hi - lo <= g)):
            stopped = "bracket" if lo < t_max else "cap"
            break
        if hi is not None and hi <= t_min:
            stopped = "nothing fits"
            break
        sides.append(value <= 1.0)
        # Regula falsi on a curved load creeps from one side: after two probes on the same side (or one pulled
        # to a bracket end that did not close it), the next probe halves the bracket.
        same_side = len(sides) >= 3 and sides[-1] == sides[-2] and hi is not None and lo is not None
        t, crept = _next_guess(points, lo, hi, g, t_min, t_max, slope, bisect=crept or same_side)
    exact = lo is not None and (lo >= t_max or (hi is not None and hi - lo <= g))
    exact = exact or (hi is not None and hi <= t_min)
    return SearchResult(lo, hi, exact, sorted(points.items()), stopped)


def _next_guess(points, lo, hi, g, t_min, t_max, slope, *, bisect: bool) -> tuple[int, bool]:
    """(next length, whether it was pulled to a bracket end): the secant's root (where the load rises through the
    two points), floored to the granule and kept strictly inside the bracket; the bracket's middle after a pulled
    probe that did not close the bracket (a load with jumps stalls the secant at one end)."""
    if bisect and lo is not None and hi is not None:
        return max(_floor((lo + hi) / 2, g), lo + g), False
    finite = {t: v for t, v in points.items() if math.isfinite(v)}
    if lo is not None and hi is not None and math.isfinite(points[hi]):
        (ta, va), (tb, vb) = (lo, points[lo]), (hi, points[hi])
    elif len(finite) >= 2:  # all on one side: the two probes nearest the other side (a load with jumps, as
        # nested blocks', is only locally affine: the nearest by load may lie before a jump)
        ends = sorted(finite.items())
        (ta, va), (tb, vb) = ends[-2:] if hi is None else ends[:2]
    elif finite and slope:
        ta, va = next(iter(finite.items()))
        tb, vb = ta + 1.0, va + slope
    else:
        ta = vb = va = tb = None
    # A load falling with T (nested blocks: a longer row takes larger blocks, so fewer host copies) has no secant
    # root ahead: double or halve the bracket instead.
    if ta is not None and (vb - va) * (tb - ta) > 0:
        guess = ta + (1.0 - va) * (tb - ta) / (vb - va)
    elif lo is not None and hi is not None:
        guess = (lo + hi) / 2
    elif lo is not None:
        guess = 2 * lo
    else:
        guess = hi / 2
    guess = _floor(min(max(guess, t_min), t_max), g)
    low = t_min if lo is None else lo + g  # strictly inside the bracket
    high = t_max if hi is None else hi - g
    pulled = min(max(guess, low), high)
    return pulled, pulled != guess


# ------------------------------------------------------------------------------------------- one probe
@dataclasses.dataclass(frozen=True)
class Settings:
    model_dir: str
    granularity: int = 1024
    t_min: int = 1024
    t_max: int = 1 << 20
    device_budget: int | None = None  # bytes; None: the device's free memory less a margin
    host_budget: int = 0              # bytes
    mlp_chunk_size: int = 8192        # 0: never tile the MLP
    probe_autotune_level: int | None = None
    max_probes: int = 8
    dtype: str = "bfloat16"
    attention: str = "auto"
    recipe: str = str(RECIPE)         # the YAML whose LoRA, optimiser and 4-bit base (load_in_4bit) the step takes
    deviceless: bool = False          # compile for the H200 target description on this (CPU) machine


def recipe(settings: Settings):
    """The recipe's TrainConfig (LoRA, optimiser, 4-bit base) for this model directory."""
    from jaxft.train import load_config

    return load_config(settings.recipe, [f"model_name_or_path={settings.model_dir}",
                                f"dataset={ROOT / 'examples' / 'data' / 'train.jsonl'}"])


def execution_for(settings: Settings, policy: str, seq: int, *, probe: bool):
    """The step's ExecutionConfig for `policy` at a row of `seq` tokens."""
    from jaxft.execution import ExecutionConfig

    chunk = settings.mlp_chunk_size
    name, (policy, extra) = policy, REMAT_OF.get(policy, (policy, {}))
    options = {}
    if probe and settings.probe_autotune_level is not None:
        options["xla_gpu_autotune_level"] = settings.probe_autotune_level
    return ExecutionConfig(attention_implementation=settings.attention, remat=policy, layer_loop="auto",
                           mlp_chunk_size=chunk if chunk and seq > chunk else None, ce_chunk_size=None,
                           host_memory_gb=settings.host_budget / GIB if name in ("offload_all", *REMAT_OF) else None,
                           compiler_options=options, **extra)


def make_run(settings: Settings, policy: str, seq: int, *, probe: bool):
    from jaxft.run import Run

    config = recipe(settings)
    devices = None
    if settings.deviceless:
        from gpu_compile import h200_topology

        devices = h200_topology().devices
    return Run(settings.model_dir, lora_config=config.lora, execution=execution_for(settings, policy, seq, probe=probe),
               optim=config.optim, total_steps=1, dtype=settings.dtype, seed=0, quant_config=config.model.quant,
               devices=devices)


def make_batch(seq: int, vocab: int, *, seed: int = 0) -> dict:
    """One row of one document: random tokens, its next-token targets (the last token has none)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = rng.integers(4, vocab, (1, seq)).astype(np.int32)
    targets = np.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    mask = np.ones((1, seq), np.float32)
    mask[:, -1] = 0
    return dict(input_ids=ids, targets=targets, loss_mask=mask, segment_ids=np.ones((1, seq), np.int32),
                positions=np.arange(seq, dtype=np.int32)[None])


def host_bytes_analytic(run, seq: int) -> int:
    """Host bytes of the policy's offloaded residuals (`jaxft.remat.offloaded_bytes`: each offloaded name x layers,
    or one layer input per nested block; the policy never names what a tiled MLP recomputes per chunk)."""
    import jax.numpy as jnp

    from jaxft.remat import offloaded_bytes

    cfg, ex = run.model_config, run.execution
    itemsize = jnp.dtype(run.dtype).itemsize
    return offloaded_bytes(ex.layer_policy(cfg, 1, seq, itemsize), cfg, 1, seq, itemsize, ex.mlp_chunk_size)


def argument_bytes(run) -> int:
    """Bytes of the step's arguments (frozen weights, LoRA, optimizer state) from shapes alone."""
    import jax

    _, lora, frozen = run.abstract_state()
    opt = jax.eval_shape(run.optimizer.init, lora)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((lora, frozen, opt)))


def analytic_device_per_token(run, seq: int) -> float:
    """A first guess of the device bytes per token of the step: the residuals the policy keeps on the device in
    every layer, plus one layer's residuals held while it is recomputed and differentiated (twice: values and
    cotangents)."""
    import jax.numpy as jnp

    from jaxft.remat import LAYER_INPUT, MLP_GATE_UP, residual_bytes

    cfg, ex = run.model_config, run.execution
    itemsize = jnp.dtype(run.dtype).itemsize
    sizes = residual_bytes(cfg, 1, seq, itemsize)
    if ex.mlp_chunk_size:
        sizes[MLP_GATE_UP] = sizes[MLP_GATE_UP] * ex.mlp_chunk_size // seq
    one_layer = sum(sizes.values())
    if ex.remat == "none":
        kept = 1.3 * one_layer  # everything, and the unnamed intermediates
    else:
        policy = ex.layer_policy(cfg, 1, seq, itemsize)
        kept = sum(sizes[n] for n in policy.save)
        if policy.kind == "full" or LAYER_INPUT not in policy.offload:
            kept += sizes[LAYER_INPUT]
        kept += (policy.block - 1) * sizes[LAYER_INPUT] / cfg.num_layers  # one block's layer inputs, spread
    return (kept * cfg.num_layers + 2 * one_layer + 4 * sizes[LAYER_INPUT]) / seq


def device_budget(settings: Settings) -> tuple[int, str]:
    if settings.device_budget is not None:
        return settings.device_budget, "--device-memory-gb"
    from jaxft.auto import default_memory_budget

    return default_memory_budget()


def probe(settings: Settings, policy: str, seq: int) -> dict[str, Any]:
    """Compiles the step of `policy` at `seq` tokens from shapes; its device and host bytes."""
    import jax

    from jaxft.auto import peak_estimate

    run = make_run(settings, policy, seq, probe=True)
    rec: dict[str, Any] = dict(policy=policy, seq=seq)
    try:
        compiled = run.compile(make_batch(seq, run.model_config.vocab_size))
    except Exception as e:  # noqa: BLE001 - a compile that runs out of memory does not fit
        text = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        rec.update(error=text, oom="RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower())
        return rec
    stats = compiled.memory_analysis()
    fields = {k: int(getattr(stats, k, 0) or 0) for k in (
        "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
        "host_argument_size_in_bytes", "host_output_size_in_bytes", "host_alias_size_in_bytes",
        "host_temp_size_in_bytes")}
    compiled_host = (fields["host_argument_size_in_bytes"] + fields["host_output_size_in_bytes"]
                     + fields["host_temp_size_in_bytes"] - fields["host_alias_size_in_bytes"])
    analytic = host_bytes_analytic(run, seq)
    rec.update(device_bytes=peak_estimate(fields), host_bytes=max(analytic, compiled_host),
               host_bytes_analytic=analytic, host_bytes_compiled=compiled_host, compile_s=round(run.compile_seconds, 2),
               temp_bytes=fields["temp_size_in_bytes"], argument_bytes=fields["argument_size_in_bytes"],
               mlp_chunk_size=run.execution.mlp_chunk_size,
               ce_chunk_size=run.execution.resolved_ce_chunk(seq, run.model_config.vocab_size,
                                                             run.model_config.hidden_size, 2),
               layer_loop=run.layer_loop, backend=jax.default_backend())
    return rec


def search_policy(settings: Settings, policy: str, *, deadline: float | None = None,
                  emit: Callable[[dict], None] = lambda rec: None, probe_fn=None) -> dict[str, Any]:
    """The longest row of `policy` (`search_max` over `probe`); every probe is passed to `emit` as it ends. No
    probe starts when the last compile's time (x 1.2) would pass `deadline` (time.time()). `probe_fn` (default
    `probe`) compiles one length."""
    probe_fn = probe_fn or probe
    budget, source = device_budget(settings)
    guide = make_run(settings, policy, settings.t_max, probe=True)
    fixed, per_token = argument_bytes(guide), analytic_device_per_token(guide, settings.t_max)
    host_per_token = host_bytes_analytic(guide, settings.t_max) / settings.t_max
    cap = settings.t_max
    if host_per_token > 0:  # the host side alone: no compile needed beyond it
        cap = min(cap, max(settings.t_min, _floor(settings.host_budget / host_per_token, settings.granularity)))
    start = (budget - fixed) / per_token if budget > fixed else settings.t_min
    records: dict[int, dict] = {}

    def load(seq: int) -> float:
        rec = dict(probe_fn(settings, policy, seq))
        records[seq] = rec
        if "error" in rec:
            value = math.inf if rec.get("oom") else math.nan
        else:
            rec["device_load"] = rec["device_bytes"] / budget
            rec["host_load"] = rec["host_bytes"] / settings.host_budget if rec["host_bytes"] else 0.0
            value = max(rec["device_load"], rec["host_load"])
        rec["load"] = value
        rec["fits"] = value <= 1.0
        emit(dict(event="probe", **rec))
        if math.isnan(value):
            raise RuntimeError(f"{policy} at {seq}: {rec['error']}")
        return value

    def should_stop() -> bool:
        last = max((r.get("compile_s", 0.0) for r in records.values()), default=0.0)
        return deadline is not None and time.time() + 1.2 * last > deadline

    began = time.perf_counter()
    try:
        result = search_max(load, int(start), settings.granularity, t_min=settings.t_min, t_max=cap,
                            max_probes=settings.max_probes, should_stop=should_stop, slope=per_token / budget)
        error = None
    except RuntimeError as e:
        result, error = None, str(e)
    best = records.get(result.best) if result and result.best else None
    out = dict(event="result", policy=policy, max_seq=result.best if result else None,
               first_failing=result.first_failing if result else None, exact=bool(result and result.exact),
               stopped=result.stopped if result else "error", error=error, device_budget=budget,
               device_budget_source=source, host_budget=settings.host_budget, host_cap_seq=cap,
               limited_by=_limit(result, cap, settings.t_max, records), probes=len(records),
               search_s=round(time.perf_counter() - began, 1),
               device_bytes=best and best["device_bytes"], host_bytes=best and best["host_bytes"],
               compile_s=best and best["compile_s"], analytic_start=int(start))
    emit(out)
    return out


def _limit(result, cap, t_max, records) -> str | None:
    """What stops the policy past its longest row: the host budget, the device budget or the search's cap."""
    if result is None or result.best is None:
        return None
    if result.best >= cap:
        return "host" if cap < t_max else "search cap (--t-max)"
    failing = records.get(result.first_failing)
    if failing is None:
        return None
    if "error" in failing:
        return "device (out of memory while compiling)"
    return "device" if failing["device_load"] > 1.0 else "host"


# ------------------------------------------------------------------------------------------- the real step
def real_step(settings: Settings, policy: str, seq: int, emit: Callable[[dict], None] = lambda rec: None) -> dict:
    """One real training step of `policy` at `seq` tokens on random weights (`Run.init_random`)."""
    import jax

    from jaxft.auto import peak_estimate

    rec: dict[str, Any] = dict(event="step", policy=policy, seq=seq)
    try:
        run = make_run(settings, policy, seq, probe=False)
        batch = make_batch(seq, run.model_config.vocab_size, seed=1)
        run.compile(batch)
        rec["compile_s"] = round(run.compile_seconds, 1)
        rec["estimate_bytes"] = peak_estimate(run.memory_analysis())
        t0 = time.perf_counter()
        run.init_random()
        jax.block_until_ready((run.frozen, run.lora, run.opt_state))
        rec["init_s"] = round(time.perf_counter() - t0, 1)
        on_device = jax.block_until_ready(jax.device_put(batch))  # on the device before the clock starts
        t0 = time.perf_counter()
        metrics = run.step(on_device, 0)
        loss = float(jax.block_until_ready(metrics["loss"]))
        rec.update(step_s=round(time.perf_counter() - t0, 2), loss=loss, grad_norm=float(metrics["grad_norm"]),
                   tokens_per_s=round(seq / (time.perf_counter() - t0), 1), ok=math.isfinite(loss))
    except Exception as e:  # noqa: BLE001 - the record says what failed
        rec.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}")
    stats = jax.devices()[0].memory_stats() or {}
    rec["peak_bytes"] = stats.get("peak_bytes_in_use")
    rec["host_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    emit(rec)
    return rec


# ------------------------------------------------------------------------------------------- the table
def unsloth_derived(budget: int, points=UNSLOTH_POINTS) -> dict[str, float]:
    """Unsloth's longest row on `budget` bytes, DERIVED from a least-squares line through its measured peaks."""
    n = len(points)
    xs, ys = [p[0] / 1024 for p in points], [p[1] for p in points]
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = my - slope * mx
    room = max(budget / GIB - intercept, 0.0)  # a budget below the intercept fits no row
    return dict(gib_per_1k_tokens=slope, intercept_gib=intercept, max_seq=int(room / slope) * 1024)


def auto_row(results: dict[str, dict]) -> dict[str, Any]:
    """auto's longest row, derived from the searched rows: auto takes the first of `AUTO_ORDER` whose compiled step
    fits the device and whose offloaded residuals fit the host (`jaxft.run.Run._host_fit`), and where offload's
    layer inputs exceed the host it runs offload in nested blocks (`remat_block: auto`, the `offload_nested` row).
    So offload reaches the longer of its two rows, every other candidate its own, auto's longest row is the longest
    of these, and the row names the first candidate that reaches it (the one auto would choose there)."""
    from jaxft.remat import AUTO_ORDER

    row_of = {remat: name for name, (remat, extra) in REMAT_OF.items() if not extra}  # LEAN_ATTN: "lean_attn"
    reach: dict[str, tuple[str, dict]] = {}  # candidate -> (the form auto runs it in, its searched row)
    for p in AUTO_ORDER:
        name = row_of.get(p, p)
        forms = [(name, results[name])] if results.get(name, {}).get("max_seq") else []
        if p == "offload" and results.get("offload_nested", {}).get("max_seq"):
            forms.append(("offload in nested blocks", results["offload_nested"]))
        if forms:
            reach[p] = max(forms, key=lambda f: f[1]["max_seq"])
    if not reach:
        return dict(policy="auto", max_seq=None, note="no candidate searched or none fits")
    seq = max(r["max_seq"] for _, r in reach.values())
    choice, row = next(reach[p] for p in AUTO_ORDER if p in reach and reach[p][1]["max_seq"] >= seq)
    note = f"derived: the longest of {', '.join(f for f, _ in reach.values())}; auto would choose {choice}"
    return dict(policy="auto", max_seq=seq, choice=choice, note=note,
                device_bytes=row.get("device_bytes"), host_bytes=row.get("host_bytes"))


def parse_points(text: str | None) -> tuple[tuple[int, float], ...]:
    """'TOKENS:GIB,...' (at least two lengths) -> ((tokens, GiB), ...); None: `UNSLOTH_POINTS`."""
    if not text:
        return UNSLOTH_POINTS
    try:
        points = tuple((int(t), float(g)) for t, g in (item.split(":") for item in text.split(",") if item.strip()))
    except ValueError:
        raise SystemExit(f"--unsloth-points {text!r}: write TOKENS:GIB pairs, e.g. 4096:6.92,16384:9.8") from None
    if len({t for t, _ in points}) < 2:
        raise SystemExit(f"--unsloth-points {text!r}: a line needs peaks at two lengths at least")
    return points


def markdown(results: dict[str, dict], step: dict | None, budget: int | None, host_budget: int,
             unsloth_points=UNSLOTH_POINTS) -> str:
    gib = lambda b: "-" if b is None else f"{b / GIB:.2f}"  # noqa: E731
    lines = [f"Device budget {gib(budget)} GiB, host budget {gib(host_budget)} GiB "
             "(compiled memory analysis; `scripts/max_context.py`).", "",
             "| policy | max T (tokens) | exact? | limited by | device GiB | host GiB | compile s | probes |",
             "|---|---:|---|---|---:|---:|---:|---:|"]
    for p, r in results.items():
        exact = "yes" if r.get("exact") else f"no ({r.get('stopped')}, first failing {r.get('first_failing')})"
        if r.get("error"):
            exact = f"error: {r['error'][:80]}"
        lines.append(f"| {p} | {r.get('max_seq') or '-'} | {exact} | {r.get('limited_by') or '-'} | "
                     f"{gib(r.get('device_bytes'))} | {gib(r.get('host_bytes'))} | {r.get('compile_s') or '-'} | "
                     f"{r.get('probes', '-')} |")
    auto = auto_row(results)
    lines.append(f"| auto (derived) | {auto.get('max_seq') or '-'} | {auto.get('note')} | | "
                 f"{gib(auto.get('device_bytes'))} | {gib(auto.get('host_bytes'))} | | |")
    if budget:
        u = unsloth_derived(budget, unsloth_points)
        at = "/".join(f"{t // 1024}k" for t, _ in unsloth_points)
        lines.append(f"| Unsloth (DERIVED, not measured: {u['gib_per_1k_tokens']:.3f} GiB per 1k tokens + "
                     f"{u['intercept_gib']:.2f} GiB, fit to its measured {at} peaks) | {u['max_seq']} | "
                     "derived | device (extrapolated) | | | | |")
    if step:
        lines += ["", f"Real step: {step.get('policy')} at {step.get('seq')} tokens: "
                  + (f"{step['step_s']} s ({step['tokens_per_s']} tokens/s), loss {step['loss']:.4f}, allocator "
                     f"peak {gib(step.get('peak_bytes'))} GiB (estimate {gib(step.get('estimate_bytes'))}), host "
                     f"peak RSS {gib(step.get('host_peak_rss_bytes'))} GiB, compile {step.get('compile_s')} s"
                     if step.get("ok") else f"FAILED: {step.get('error')}")]
    return "\n".join(lines) + "\n"


def from_probes(policy: str, probes: list[dict], stopped: str) -> dict[str, Any]:
    """A policy's result from the probes a worker reported before it was stopped (not exact)."""
    fits = [p for p in probes if p.get("fits")]
    fails = [p for p in probes if p.get("fits") is False]
    best = max(fits, key=lambda p: p["seq"]) if fits else None
    return dict(event="result", policy=policy, max_seq=best and best["seq"], exact=False, stopped=stopped,
                first_failing=min((p["seq"] for p in fails), default=None), probes=len(probes),
                device_bytes=best and best["device_bytes"], host_bytes=best and best["host_bytes"],
                compile_s=best and best["compile_s"], limited_by=None, error=None)


# ------------------------------------------------------------------------------------------- driver
def model_dir(model: str, layers: int | None, workdir: str) -> str:
    """A directory with the config.json of `model` (a shape of scripts/bench/workloads.py SHAPES or a
    directory), with `layers` layers if given."""
    if os.path.isdir(model):
        config = json.loads((Path(model) / "config.json").read_text())
    else:
        from bench.workloads import SHAPES

        if model not in SHAPES:
            raise SystemExit(f"--model {model!r}: not a directory and not a shape of scripts/bench/workloads.py "
                             f"(shapes: {', '.join(SHAPES)})")
        config = SHAPES[model].config_dict()
    if layers is not None:
        config["num_hidden_layers"] = layers
    if os.path.isdir(model) and layers is None:
        return model
    (Path(workdir) / "config.json").write_text(json.dumps(config))
    return workdir


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="a shape of scripts/bench/workloads.py, or a directory "
                    "with a config.json")
    ap.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--granularity", type=int, default=1024)
    ap.add_argument("--t-min", type=int, default=None, help="shortest row searched (default: one granule)")
    ap.add_argument("--t-max", type=int, default=1 << 20)
    ap.add_argument("--max-probes", type=int, default=8, help="compiles per policy at most")
    ap.add_argument("--device-memory-gb", type=float, default=None,
                    help="device budget in GiB (default: the device's free memory less max(1 GiB, 5%%))")
    ap.add_argument("--host-memory-gb", type=float, default=None,
                    help="host memory in GiB (default: the machine's); the budget is that less max(8 GiB, 10%%)")
    ap.add_argument("--mlp-chunk-size", type=int, default=8192, help="tile the MLP of rows longer than this (0: off)")
    ap.add_argument("--probe-autotune-level", type=int, default=None,
                    help="xla_gpu_autotune_level of the probes (default: 0 on a GPU, not set elsewhere)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--recipe", default=str(RECIPE), help="the YAML the step takes its LoRA, optimiser and base "
                    "from (default examples/bench/auto.yaml; examples/bench/qlora.yaml: the 4-bit base of QLoRA, "
                    "quantised from shapes, so no real step: --step-seq 0)")
    ap.add_argument("--unsloth-points", default=None, help="Unsloth's measured peaks for its derived row, "
                    "'TOKENS:GIB,...' (default: its bf16 LoRA peaks at 16k/32k/64k, issue #10)")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--deadline-s", type=float, default=300.0, help="the whole run ends within this many seconds")
    ap.add_argument("--jobs", type=int, default=None,
                    help="policies searched at once, each in its own process (0: in this process, one after "
                         "another; default: min(policies, cpus / 3) on a GPU, 0 elsewhere)")
    ap.add_argument("--step-policy", default="offload")
    ap.add_argument("--step-seq", default="262144", help="tokens of the real step; 'max': the step policy's longest "
                    "row (after the searches); 0: no step")
    ap.add_argument("--deviceless", action="store_true", help="compile for an H200 on this machine instead of "
                    "using its device (scripts/deviceless/gpu_compile.py; needs JAX_CUDA_PLUGIN_DIR, "
                    "--device-memory-gb and --step-seq 0; attention 'auto' becomes 'pallas', no autotuning)")
    ap.add_argument("--out", default=None, help="JSON lines (every probe, result and the step)")
    ap.add_argument("--md", default=None, help="the markdown table")
    ap.add_argument("--worker", choices=("search", "step"), help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    ap.add_argument("--deadline-at", type=float, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _print(rec: dict) -> None:
    print(json.dumps(rec), flush=True)


def _deviceless() -> None:
    """Sets up the compile for the H200 target (before JAX is first imported: the CUDA plugin's start-up check)."""
    import importlib

    sys.path.insert(0, str(ROOT / "scripts" / "deviceless"))
    importlib.import_module("gpu_compile")


def _resolve(settings: Settings) -> Settings:
    """Settings as the worker's backend needs them: probes compile without autotuning on a GPU (and for one) by
    default."""
    import jax

    if settings.probe_autotune_level is None and (settings.deviceless or jax.default_backend() == "gpu"):
        return dataclasses.replace(settings, probe_autotune_level=0)
    return settings


def worker(args) -> int:
    settings = Settings(**json.loads(args.settings))
    if settings.deviceless:
        _deviceless()
    settings = _resolve(settings)
    if args.worker == "search":
        search_policy(settings, args.policy, deadline=args.deadline_at, emit=_print)
    else:
        real_step(settings, args.policy, args.seq, emit=_print)
    return 0


class Collector:
    """Every record of every worker, written to stdout and --out as it arrives (threads share it)."""

    def __init__(self, path: str | None):
        self.lock = threading.Lock()
        self.records: list[dict] = []
        self.file = open(path, "w") if path else None

    def __call__(self, rec: dict) -> None:
        with self.lock:
            self.records.append(rec)
            line = json.dumps(rec)
            print(line, flush=True)
            if self.file:
                self.file.write(line + "\n")
                self.file.flush()


def _spawn(args, settings: Settings, kind: str, policy: str, seq: int | None, deadline_at: float,
           collect: Collector, tag: dict) -> None:
    """Runs one worker process, forwarding its JSON lines; killed (this process's own child) past the deadline."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--policy", policy,
           "--settings", json.dumps(dataclasses.asdict(settings)), "--deadline-at", str(deadline_at)]
    if seq is not None:
        cmd += ["--seq", str(seq)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "scripts"),
                                                       os.environ.get("PYTHONPATH", "")]))
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    timer = threading.Timer(max(deadline_at - time.time(), 1.0), proc.kill)
    timer.start()
    err_tail: list[str] = []
    drain = threading.Thread(target=lambda: err_tail.extend(proc.stderr.readlines()[-20:]), daemon=True)
    drain.start()
    for line in proc.stdout:
        if line.startswith("{"):
            collect(dict(json.loads(line), **tag))
    proc.wait()
    timer.cancel()
    drain.join(timeout=5)
    if proc.returncode != 0:
        collect(dict(event="worker_exit", kind=kind, policy=policy, returncode=proc.returncode,
                     killed_at_deadline=proc.returncode == -9, stderr_tail="".join(err_tail)[-1500:], **tag))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    began = time.time()
    deadline = began + args.deadline_s
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise SystemExit(f"--policies: {bad[0]!r} is not one of {', '.join(POLICIES)} (auto is derived from them)")
    points = parse_points(args.unsloth_points)
    if args.deviceless:
        if args.device_memory_gb is None or args.step_seq != "0":
            raise SystemExit("--deviceless: pass --device-memory-gb (there is no device to ask) and --step-seq 0 "
                             "(nothing can run)")
        _deviceless()
        if args.attention == "auto":  # cuDNN does not lower without cuDNN installed; the flash kernel does
            args.attention = "pallas"
    from jaxft.remat import default_host_budget

    host_budget = default_host_budget(int(args.host_memory_gb * GIB) if args.host_memory_gb else None)
    if host_budget <= 0:
        raise SystemExit(f"--host-memory-gb {args.host_memory_gb}: nothing left after the 8 GiB margin; pass more")
    workdir = tempfile.mkdtemp(prefix="max_context_")
    settings = Settings(model_dir=model_dir(args.model, args.layers, workdir), granularity=args.granularity,
                        t_min=args.t_min or args.granularity, t_max=args.t_max,
                        device_budget=None if args.device_memory_gb is None else int(args.device_memory_gb * GIB),
                        host_budget=host_budget, mlp_chunk_size=args.mlp_chunk_size,
                        probe_autotune_level=args.probe_autotune_level, max_probes=args.max_probes,
                        dtype=args.dtype, attention=args.attention, recipe=args.recipe, deviceless=args.deviceless)
    if args.step_seq != "0" and recipe(settings).model.quant is not None:
        raise SystemExit(f"--recipe {args.recipe}: a 4-bit base has no random-weight step (Run.init_random makes "
                         "no 4-bit codes); pass --step-seq 0 (the search compiles from shapes and needs none)")
    collect = Collector(args.out)
    collect(dict(event="start", model=args.model, layers=args.layers, policies=policies, settings=dataclasses.asdict(settings),
                 deadline_s=args.deadline_s, step_policy=args.step_policy, step_seq=args.step_seq))
    step_seq = None if args.step_seq in ("0", "max") else int(args.step_seq)
    jobs = args.jobs
    if jobs is None:
        gpu = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True,
                             text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")).stdout.strip().endswith("gpu")
        jobs = min(len(policies), max(1, (os.cpu_count() or 3) // 3)) if gpu else 0
    results: dict[str, dict] = {}
    if jobs == 0:  # in this process, one after another
        local = _resolve(settings)
        for p in policies:
            results[p] = search_policy(local, p, deadline=deadline, emit=collect)
        if args.step_seq == "max" and results.get(args.step_policy, {}).get("max_seq"):
            step_seq = results[args.step_policy]["max_seq"]
        step = real_step(local, args.step_policy, step_seq, emit=collect) if step_seq else None
    else:
        threads = []
        if step_seq:  # beside the searches: its compile and step are most of the call's time
            threads.append(threading.Thread(target=_spawn, args=(args, settings, "step", args.step_policy, step_seq,
                                                                 deadline, collect, {})))
        pending = list(policies)
        lock = threading.Lock()

        def searcher():
            while True:
                with lock:
                    if not pending:
                        return
                    p = pending.pop(0)
                _spawn(args, settings, "search", p, None, deadline - 5, collect, {})

        threads += [threading.Thread(target=searcher) for _ in range(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for p in policies:
            done = [r for r in collect.records if r.get("event") == "result" and r.get("policy") == p]
            probes = [r for r in collect.records if r.get("event") == "probe" and r.get("policy") == p]
            results[p] = done[-1] if done else from_probes(p, probes, "killed at the deadline")
        step = None
        if args.step_seq == "max" and results.get(args.step_policy, {}).get("max_seq"):
            _spawn(args, settings, "step", args.step_policy, results[args.step_policy]["max_seq"],
                   began + args.deadline_s + 600, collect, {})
        steps = [r for r in collect.records if r.get("event") == "step"]
        step = steps[-1] if steps else ({"policy": args.step_policy, "seq": step_seq, "ok": False,
                                         "error": "killed at the deadline (or the worker died: see worker_exit)"}
                                        if step_seq or args.step_seq == "max" else None)
    budget = next((r.get("device_budget") for r in results.values() if r.get("device_budget")), None)
    auto = auto_row(results)
    summary = dict(event="summary", results=results, auto=auto, step=step, device_budget=budget,
                   host_budget=host_budget, unsloth_points=points,
                   unsloth_derived=unsloth_derived(budget, points) if budget else None,
                   wall_s=round(time.time() - began, 1))
    collect(summary)
    text = markdown(results, step, budget, host_budget, points)
    print(text)
    if args.md:
        Path(args.md).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
