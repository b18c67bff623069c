"""One probe of experiments/probes/max_context.py (the step of a remat policy at one length, compiled from shapes: its
device and host bytes), a policy's search over probes, and the real step on random weights. JAX and jaxft are imported
inside the functions, after the script has set the device up."""

from __future__ import annotations

import dataclasses
import math
import resource
import time
from pathlib import Path
from typing import Any, Callable

from experiments.probes.maxctx.search import _floor, search_max

ROOT = Path(__file__).resolve().parents[3]
GIB = 2**30
POLICIES = ("none", "full", "offload", "offload+attn", "lean_attn", "offload_nested")
# Policies of this script that are a remat policy plus execution settings: "offload_nested" is remat offload with
# nested blocks sized to the host budget (`remat_block: auto`, jaxft.memory.policy); "lean_attn" names the selective
# policy `jaxft.memory.policy.LEAN_ATTN` (`--policies` is split on commas; this module imports no JAX before the device
# is set up).
REMAT_OF = {"offload_nested": ("offload", {"remat_block": "auto"}),
            "lean_attn": ("offload=layer_input,attn_out,attn_lse", {})}
RECIPE = ROOT / "examples" / "bench" / "auto.yaml"


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
    from jaxft.memory.execution import ExecutionConfig

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
        from experiments.deviceless.gpu_compile import h200_topology

        devices = h200_topology().devices
    return Run(settings.model_dir, lora_config=config.lora_config,
               execution=execution_for(settings, policy, seq, probe=probe), optim=config.optim_config, total_steps=1,
               dtype=settings.dtype, seed=0, quant_config=config.quant_config,
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
    """Host bytes of the policy's offloaded residuals (`jaxft.memory.policy.offloaded_bytes`: each offloaded name x
    layers, or one layer input per nested block; the policy never names what a tiled MLP recomputes per chunk)."""
    import jax.numpy as jnp

    from jaxft.memory.policy import offloaded_bytes

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

    from jaxft.memory.policy import LAYER_INPUT, MLP_GATE_UP, residual_bytes

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
    from jaxft.memory import default_memory_budget

    return default_memory_budget()


def probe(settings: Settings, policy: str, seq: int) -> dict[str, Any]:
    """Compiles the step of `policy` at `seq` tokens from shapes; its device and host bytes."""
    import jax

    from jaxft.memory import peak_estimate

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

    from jaxft.memory import peak_estimate

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
