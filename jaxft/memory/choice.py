"""The automatic choices, made from compiled memory estimates before any weight moves: `mesh: auto`
(`choose_mesh`), `remat: auto` (`choose_remat`: a policy of `jaxft.memory.policy.AUTO_ORDER`, or full remat on the
first k layers), and after the load the re-choice that fits the allocator's room (`fit_allocator`).

They are functions over a compile callback: the caller (`jaxft.run.Run`) compiles each candidate they name and
hands back XLA's memory analysis (`Compiled`); they read what they plan for from a `Target`, record every compile
in `Trials` and return a `Decision`. Nothing here holds or changes the caller's state.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxft.errors import ConfigError
from jaxft.memory import policy as remat_policies
from jaxft.memory.budget import ALLOCATOR_SLACK, GIB, contiguous_room, host_is_device, peak_estimate, step_budget
from jaxft.memory.execution import ExecutionConfig, ExecutionConfigError
from jaxft.memory.policy import AUTO_ORDER, AUTO_PROBE_DEPTH, AUTO_PROBE_LAYERS

logger = logging.getLogger("jaxft.run")  # the run's channel: these lines are the run's choices

STREAMED = " (weights on host)"  # the suffix of a candidate's name whose frozen weights stream (`frozen_weights`)


def candidate_name(policy: str, layers: int | None, streamed: bool = False) -> str:
    """A `remat: auto` candidate's name in `Trials.estimates` and the log: the policy, or "full on 2 layers" for
    full remat on the first 2 layers; "offload (weights on host)" with the frozen weights streamed."""
    return (policy if layers is None else f"{policy} on {layers} layers") + (STREAMED if streamed else "")


class MemoryBudgetError(ExecutionConfigError):
    """No step fits the device budget. `field` is max_memory_gb, the key that sets the budget; the message
    starts with it only where the user set it (`keyed`): a default budget's refusal names the memory it read."""

    def __init__(self, problem: str, *, keyed: bool):
        self.field, self.problem, self.keyed = "max_memory_gb", problem, keyed
        ConfigError.__init__(self, f"key 'max_memory_gb': {problem}" if keyed else problem)


class Compiled(NamedTuple):
    """What the compile callback returns for one candidate: XLA's memory analysis of the compiled step (bytes, the
    keys of `jaxft.run.Run.memory_analysis`) and the compile's seconds."""

    analysis: dict[str, int]
    seconds: float


# compile(execution, depth=None, mesh=None) -> Compiled: the step under `execution`, on the first `depth` layers of
# the model (None: all of them; a shallow copy is compiled from shapes and leaves the caller's step as it was), on
# `mesh` (None: the caller's). Each full-depth compile is the caller's step from then on: the last one a choice
# makes is the step it chose.
CompileFn = Callable[..., Compiled]


@dataclasses.dataclass(frozen=True)
class Target:
    """What the choices plan for: the model, the step's devices (every process's), the micro-batches of a step, the
    activation dtype, whether expert layers run the Mosaic GPU kernels (`jaxft.run.Run.mosaic_experts`: those
    need the layer scan), the bytes of the frozen weights `frozen_weights: host` streams (read from shapes, when
    asked), the host's available memory (the CPU device budget's source) and whether LEAN_ATTN's host copies pay
    on a batch (`copies_pay(host_batch)`: `jaxft.memory.policy.attention_copies_pay` on one micro-batch)."""

    model_config: Any  # jaxft.config.ModelConfig
    devices: tuple
    accumulation: int
    dtype: str
    mosaic_experts: bool
    weight_bytes: Callable[[], int]
    host_memory: Callable[[], tuple[int, str]]
    copies_pay: Callable[[dict[str, np.ndarray]], tuple[bool, float, float]]

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    def budget(self, execution: ExecutionConfig) -> tuple[int, str]:
        """(bytes, where from) a step may plan to use on each device (`jaxft.memory.budget.step_budget`)."""
        return step_budget(execution.max_memory_gb, self.devices, self.host_memory)

    def budget_is_host_memory(self, execution: ExecutionConfig) -> bool:
        """Whether the default budget is the host's own memory (no `max_memory_gb`, CPU devices): where it is,
        offloading to host memory or streaming weights from it spares nothing, and those candidates are skipped."""
        return execution.max_memory_gb is None and host_is_device(self.devices[0])


@dataclasses.dataclass
class Trials:
    """What `remat: auto` compiled, in order, and estimated: `estimates` {candidate name (`candidate_name`):
    estimated peak bytes} at the model's depth; `probes` the same for shallow copies (`_shallow_probe`);
    `compiles` [(policy, remat_layers, model depth)] (a depth below the model's is a probe); `slope` the bytes full
    remat saves per layer where measured (`_partial_remat`); `seconds` the compiles' time."""

    estimates: dict[str, int] = dataclasses.field(default_factory=dict)
    probes: dict[str, int] = dataclasses.field(default_factory=dict)
    compiles: list[tuple[str, int | None, int]] = dataclasses.field(default_factory=list)
    slope: float | None = None
    seconds: float = 0.0

    def clear(self) -> None:
        self.estimates.clear()
        self.probes.clear()
        self.compiles.clear()
        self.slope, self.seconds = None, 0.0

    def choice(self, execution: ExecutionConfig) -> tuple[str, int] | None:
        """`execution`'s candidate name and estimated peak bytes; None when auto has not run."""
        if not self.estimates:
            return None
        name = candidate_name(execution.remat, execution.remat_layers, execution.frozen_weights == "host")
        return name, self.estimates[name]


@dataclasses.dataclass(frozen=True)
class Decision:
    """A choice: the execution (and, for `mesh: auto`, the mesh) chosen, its step the last one compiled."""

    execution: ExecutionConfig
    mesh: Any = None  # jaxft.sharding.MeshConfig


def _refusal(execution: ExecutionConfig, what: str, fixes: str) -> MemoryBudgetError:
    """The error of a budget nothing fits, stated on the key `max_memory_gb` only where the user set it."""
    if execution.max_memory_gb is not None:
        return MemoryBudgetError(f"{what}; raise max_memory_gb, {fixes}", keyed=True)
    return MemoryBudgetError(f"{what}; free memory (other processes hold the rest), {fixes}, or set "
                             "max_memory_gb (GiB per device) to plan for more than this", keyed=False)


# ---------------------------------------------------------------------------------------------- mesh: auto
def choose_mesh(target: Target, mesh_config, execution: ExecutionConfig, host_batch: dict[str, np.ndarray],
                compile: CompileFn, *, trials: Trials | None = None, log=logger.info) -> Decision:
    """Resolves `mesh: auto`: compiles the step from shapes on each mesh of `mesh_config.candidates` (least
    communication first: pure data parallel, then more fsdp) and keeps the first whose estimated per-device peak
    (`peak_estimate`) fits the budget (`max_memory_gb`, else the device's free memory); with `remat: auto` each
    mesh gets its own remat choice (`choose_remat`). Logs one line per mesh tried and the choice; the chosen step is
    the last compiled. Raises ExecutionConfigError on key max_memory_gb when no mesh fits. Runs before the load
    (the mesh decides where the weights go)."""
    trials = Trials() if trials is None else trials
    budget, source = target.budget(execution)
    candidates = mesh_config.candidates(len(target.devices))
    log(f"mesh auto: device budget {budget / GIB:.3f} GiB ({source}); candidates in order of communication: "
        f"{', '.join(c.describe() for c in candidates)}")
    estimates = {}
    for mesh in candidates:
        chosen = execution
        on_mesh = lambda ex, depth=None, mesh=mesh: compile(ex, depth=depth, mesh=mesh)  # noqa: E731
        if execution.remat == "auto":
            try:
                chosen = choose_remat(target, execution, host_batch, on_mesh, trials=trials, log=log,
                                      budget=(budget, source)).execution
            except ExecutionConfigError:
                if not trials.estimates:  # refused before compiling: no candidate can fit this budget
                    raise
                estimates[mesh.describe()] = min(trials.estimates.values())
                log(f"mesh auto: {mesh.describe()} no remat policy fits -> does not fit")
                continue
            estimate = trials.choice(chosen)[1]
        else:
            estimate = peak_estimate(on_mesh(execution).analysis)
        estimates[mesh.describe()] = estimate
        fits = estimate <= budget
        log(f"mesh auto: {mesh.describe()} estimated peak {estimate / GIB:.3f} GiB per device -> "
            f"{'fits: chosen' if fits else 'does not fit'}")
        if fits:
            return Decision(chosen, mesh)
    smallest = min(estimates, key=estimates.get)
    raise _refusal(execution, f"no mesh fits in {budget / GIB:.3f} GiB per device ({source}): the smallest "
                   f"estimate is {smallest} at {estimates[smallest] / GIB:.3f} GiB", "use more devices, or lower "
                   "per_device_train_batch_size / max_seq_length")


# ---------------------------------------------------------------------------------------------- remat: auto
def choose_remat(target: Target, execution: ExecutionConfig, host_batch: dict[str, np.ndarray], compile: CompileFn,
                 *, trials: Trials | None = None, log=logger.info, budget: tuple[int, str] | None = None) -> Decision:
    """Resolves `remat: auto` in `execution`: compiles the step from shapes for each policy of
    `jaxft.memory.policy.AUTO_ORDER` (fastest expected first), estimates its device peak (`peak_estimate`) and
    keeps the first within `max_memory_gb` (default `default_memory_budget`); between "none" and the next policy it
    tries full remat on the first k layers (`_partial_remat`) while k layers recompute less than offload+attn on
    this batch (`jaxft.memory.policy.partial_full_limit`), else after offload+attn if that does not fit. LEAN_ATTN
    moves after offload (one line) where its host copies cost more than the attention forward they spare
    (`auto_order`). Every compile logs one line (what, its estimate, and why it was compiled); slower candidates
    than the choice are not compiled. The chosen step is the last compiled; `trials` records every compile (and
    `trials.seconds` their time).
    Raises ExecutionConfigError (one line, with the smallest estimate) when nothing fits, at once when the
    budget cannot hold the frozen weights alone. Where the budget is the host's own memory (CPU devices, no
    max_memory_gb: `Target.budget_is_host_memory`), candidates that offload to the host or stream the weights
    from it are skipped: they would move bytes within the same memory. `budget`: (bytes, where from) to plan
    in (`choose_mesh` passes its own); None: `Target.budget`.
    Runs before the load: the policy decides the layer loop, hence the weight layout."""
    trials = Trials() if trials is None else trials
    base = original = execution
    budget, source = budget or target.budget(execution)
    order, why = auto_order(target, host_batch)
    on_host = target.budget_is_host_memory(execution)
    if on_host:
        order, why = tuple(p for p in order if not remat_policies.parse(p).offloads), None
    log(f"remat auto: device budget {budget / GIB:.2f} GiB ({source}); candidates in order of expected speed: "
        f"{', '.join(order)}" + (" (host-offloading policies skipped: the device's memory is the host's)"
                                 if on_host else ""))
    if why:
        log(why)
    trials.clear()
    _refuse_at_once(target, execution, budget, source, on_host)
    chosen = None  # the execution of the candidate that fitted (its step the last compiled)

    def fits(policy: str, layers: int | None = None, *, probe: bool = False) -> bool:
        """Compiles `policy` (on the first `layers` layers) at the model's depth and says whether it fits; a
        fitting probe is measured, not chosen, so it neither logs "chosen" nor ends the compile count."""
        nonlocal chosen
        name = candidate_name(policy, layers, base.frozen_weights == "host")
        on = host_fit(target, base.replace(remat=policy), host_batch, log)
        if on is None:
            return False
        estimate = trials.estimates[name] = _compile_candidate(
            target, compile, trials, on.replace(remat=policy, remat_layers=layers), None, name,
            lambda e: ("fits (probe)" if probe else "fits: chosen") if e <= budget else "does not fit", log)
        if estimate <= budget and not probe:
            chosen = on.replace(remat=policy, remat_layers=layers)
        return estimate <= budget

    def shallow(layers: int, depth: int) -> int:
        return _shallow_probe(target, compile, trials, base, layers, depth, log)

    segments = host_batch.get("segment_ids", np.ones_like(host_batch["input_ids"]))
    limit = remat_policies.partial_full_limit(remat_policies.recompute_work(target.model_config, segments))
    # The weights on the device first; streamed from host memory (one device) when nothing fits there or
    # `frozen_weights: host` asks for it. Streamed candidates run in the layer scan: no full remat on the first k
    # layers (unrolled).
    streams = len(target.devices) == 1 and not on_host
    placements = {"device": ["device"], "host": ["host"]}.get(
        base.frozen_weights, ["device", "host"] if streams else ["device"])
    for weights in placements:
        if weights == "host" and original.frozen_weights == "auto":
            log("remat auto: no policy fits with the frozen weights on the device; the same candidates with "
                "them streamed from pinned host memory (frozen_weights host)")
        base = base.replace(frozen_weights=weights)
        deferred = None  # full remat on the first k layers, passed over for offload+attn: (k, per-layer saving)
        for policy in order:
            if policy == "full" and deferred is not None and \
                    _partial_at(target, trials, fits, *deferred, budget, log)[0]:
                return Decision(chosen)  # offload+attn did not fit; k layers beat full remat on all of them
            if fits(policy):
                rest = order[order.index(policy) + 1:]
                if rest:
                    log(f"remat auto: chose {policy}{STREAMED if weights == 'host' else ''} (not compiled: "
                        f"{', '.join(rest)}, expected slower)")
                return Decision(chosen)
            if policy == "none" and weights == "device":
                fitted, deferred = _partial_remat(target, base, trials, fits, shallow, budget, limit, log)
                if fitted:
                    return Decision(chosen)
    smallest = min(trials.estimates, key=trials.estimates.get)
    raise _refusal(original, f"no remat policy fits in {budget / GIB:.3f} GiB ({source}): the smallest estimate is "
                   f"{smallest} at {trials.estimates[smallest] / GIB:.3f} GiB",
                   "or lower per_device_train_batch_size / max_seq_length")


def _refuse_at_once(target: Target, execution: ExecutionConfig, budget: int, source: str, on_host: bool) -> None:
    """Raises `MemoryBudgetError` before any compile where a default budget (no max_memory_gb) cannot hold a
    step: it is not positive, or one device would hold the frozen weights (CPU: always, nothing streams) and
    they alone exceed it. A budget the user set is tried candidate by candidate, to name the smallest."""
    if execution.max_memory_gb is not None:
        return
    if budget <= 0:
        raise _refusal(execution, f"the memory left for the step is {budget / GIB:.3f} GiB per device ({source})",
                       "or lower per_device_train_batch_size / max_seq_length")
    if len(target.devices) == 1 and (on_host or execution.frozen_weights == "device"):
        weights = target.weight_bytes()
        if weights > budget:
            raise _refusal(execution, f"the frozen weights alone take {weights / GIB:.3f} GiB, over the "
                           f"{budget / GIB:.3f} GiB the step may use ({source})",
                           "load_in_4bit, use more devices (mesh with fsdp), or a smaller model")


def auto_order(target: Target, host_batch: dict[str, np.ndarray]) -> tuple[tuple[str, ...], str | None]:
    """(`jaxft.memory.policy.AUTO_ORDER` for this batch, a line saying why it differs or None). Where LEAN_ATTN's
    host copies (the attention's output and statistics) are expected to cost more than the attention forward they
    spare the backward (`Target.copies_pay`: short documents, narrow windows, short rows), it moves after offload:
    full and offload, which recompute the attention, are then expected faster, and it stays for a device neither
    fits (it keeps about offload's device memory, a little less)."""
    pays, saved, copies = target.copies_pay(host_batch)
    if pays:
        return AUTO_ORDER, None
    lean = remat_policies.LEAN_ATTN
    return tuple(p for p in AUTO_ORDER if p != lean) + (lean,), (
        f"remat auto: {lean} tried after offload: its attention copies to host cost about {copies / 1e12:.1f} "
        f"TFLOP of matmul time a step, more than the attention forward they spare ({saved / 1e12:.1f} TFLOP)")


def host_fit(target: Target, ex: ExecutionConfig, host_batch: dict[str, np.ndarray], log) -> ExecutionConfig | None:
    """`ex` if what its policy offloads, with the streamed weights under `frozen_weights: host`, fits the host
    budget (`host_memory_gb`, else the machine's memory less a margin: `jaxft.memory.policy.default_host_budget`);
    for "offload" (weights on the device) that does not fit, `ex` in nested blocks sized to the budget
    (`remat_block: auto`); None (logged) for another policy that does not fit. The bytes are those of the
    micro-batch this process holds (several local devices' shards together)."""
    streamed = target.weight_bytes() if ex.frozen_weights == "host" else 0
    offloads = remat_policies.parse(ex.remat).offloads
    if not offloads and not streamed:
        return ex
    cfg, itemsize = target.model_config, target.itemsize
    rows, seq = host_batch["input_ids"].shape[0] // target.accumulation, host_batch["input_ids"].shape[-1]
    need = streamed + (remat_policies.offloaded_bytes(ex.layer_policy(cfg, rows, seq, itemsize), cfg, rows, seq,
                                                      itemsize, ex.mlp_chunk_size) if offloads else 0)
    host = ex.host_budget_bytes()
    if need <= host:
        return ex
    if ex.remat == "offload" and ex.remat_block is None and not streamed:
        nested = ex.replace(remat_block="auto")
        k = nested.block_for(cfg, rows, seq, itemsize)
        log(f"remat auto: offload's layer inputs need {need / GIB:.2f} GiB of host memory, over the host budget "
            f"{host / GIB:.2f} GiB: offload in nested blocks of {k} layers (remat_block auto)")
        return nested
    what = "offloads" + (f" (with {streamed / GIB:.2f} GiB of streamed weights)" if streamed else "")
    log(f"remat auto: {ex.remat:<12} {what} {need / GIB:.2f} GiB, over the host budget {host / GIB:.2f} GiB "
        "-> does not fit (host)")
    return None


def _compile_candidate(target: Target, compile: CompileFn, trials: Trials, execution: ExecutionConfig,
                       depth: int | None, name: str, verdict, log) -> int:
    """`remat: auto`'s one compile: `execution` on the first `depth` layers (None: the model), recorded in
    `trials`, logged as one line ending in `verdict(estimate)`; returns the estimate (`peak_estimate`)."""
    m, seconds = compile(execution, depth=depth)
    trials.seconds += seconds
    trials.compiles.append((execution.remat, execution.remat_layers, depth or target.model_config.num_layers))
    estimate = peak_estimate(m)
    log(f"remat auto: {name:<12} estimated peak {estimate / GIB:.3f} GiB (arguments "
        f"{m.get('argument_size_in_bytes', 0) / GIB:.3f} + outputs {m.get('output_size_in_bytes', 0) / GIB:.3f}"
        f" + temp {m.get('temp_size_in_bytes', 0) / GIB:.3f} - aliased {m.get('alias_size_in_bytes', 0) / GIB:.3f}"
        f" + allocator slack {ALLOCATOR_SLACK * m.get('argument_size_in_bytes', 0) / GIB:.3f})"
        f" -> {verdict(estimate)}")
    return estimate


def _shallow_probe(target: Target, compile: CompileFn, trials: Trials, base: ExecutionConfig, layers: int,
                   depth: int, log) -> int:
    """Full remat on the first `layers` layers of a `depth`-layer copy of the model (the compile callback's
    `depth`: same widths, embeddings and head, compiled from shapes), recorded in `trials.probes`; returns its
    estimate."""
    name = f"full on {layers} of a {depth}-layer copy"
    trials.probes[name] = _compile_candidate(target, compile, trials, base.replace(remat="full", remat_layers=layers),
                                             depth, name, lambda e: "probe (per-layer saving of full remat)", log)
    return trials.probes[name]


def _full_remat_saving(target: Target, trials: Trials, shallow, everywhere, log) -> tuple[float, str] | None:
    """(bytes full remat saves per layer, how it was measured): from `shallow(layers, depth)` (full remat on
    `AUTO_PROBE_LAYERS` of the first `AUTO_PROBE_DEPTH` layers of a shallow copy, see `_partial_remat`), or,
    for a model no deeper than the copy or with no valid copy, from `everywhere()` (the estimate of full
    remat on every layer at full depth against "none"'s; None: not measured, and neither is the saving)."""
    layers = target.model_config.num_layers
    depth, (few, more) = AUTO_PROBE_DEPTH, AUTO_PROBE_LAYERS
    probing = layers > depth
    if probing:
        try:
            target.model_config.first_layers(depth)
        except ConfigError as e:  # e.g. a MoE model whose first layers are all dense
            log(f"remat auto: no {depth}-layer copy of this model ({e}); full on every layer is compiled instead")
            probing = False
    if probing:
        return ((shallow(few, depth) - shallow(more, depth)) / (more - few),
                f"full on {few} and on {more} of a {depth}-layer copy")
    full = everywhere()
    if full is None:
        return None
    return (trials.estimates["none"] - full) / layers, f"full on all {layers} layers"


def _partial_remat(target: Target, base: ExecutionConfig, trials: Trials, fits, shallow, budget: int, limit: int,
                   log) -> tuple[bool, tuple[int, float] | None]:
    """After "none" does not fit: full remat on the first k layers only (`remat_layers`), the smallest k that
    fits by full remat's per-layer saving, then checked by compiling k itself at the model's depth (once more
    with k grown by the remaining excess if the estimate was short). Models of 4 layers or more (below, one
    layer is within the noise) whose loop can unroll (not an MoE model on the Mosaic GPU expert kernels:
    `ExecutionConfig.unrolls`). Taken only while k <= `limit` (`jaxft.memory.policy.partial_full_limit` on this batch):
    beyond it offload+attn (next in `AUTO_ORDER`), which recomputes every layer's projections and MLP but no attention,
    is expected to recompute less. Returns (whether a k fitted: its step is then the last compiled, (k, per-layer
    saving) when k was passed over for being beyond `limit`, for `_partial_at` should offload+attn not fit).

    The per-layer saving is measured on a shallow copy of the model (its first
    `jaxft.memory.policy.AUTO_PROBE_DEPTH` layers, compiled from shapes), as the difference between full remat on
    two numbers of its first layers (`AUTO_PROBE_LAYERS`), per layer: the quantity k needs, in the program
    partial remat runs, at a few layers' compile time instead of full remat on every layer at full depth.
    Only a slope is taken from the copy: a policy's peak is close to affine in the depth, but the intercept
    a shallow program shows is not the deep one's (XLA reuses more buffers in a deep program), and what
    does not grow with the rematerialised layers (full remat's smaller cross-entropy chunk) cancels in the
    difference. Models no deeper than the copy (or with no valid copy) measure it from full remat on every
    layer at full depth."""
    layers = target.model_config.num_layers
    none = trials.estimates["none"]
    if layers < 4 or base.layer_loop == "scan":  # remat_layers needs the unrolled loop
        return False, None
    if base.layer_loop == "auto" and target.mosaic_experts:  # auto scans these (`ExecutionConfig.unrolls`)
        log("remat auto: no full remat on the first layers only (it needs unrolled layers, whose Mosaic GPU "
            "expert kernels compile for minutes); offload+attn is next")
        return False, None
    saving = _full_remat_saving(
        target, trials, shallow,
        lambda: trials.estimates[f"full on {layers} layers"] if fits("full", layers, probe=True) else None, log)
    if saving is None:
        return False, None
    per_layer, how = saving
    trials.slope = per_layer
    k = math.ceil((none - budget) / per_layer) if per_layer > 0 else layers
    log(f"remat auto: full remat saves {per_layer / GIB:.3f} GiB per layer ({how}); none is "
        f"{(none - budget) / GIB:.3f} GiB over the budget -> "
        + (f"full on {k} layers predicted to fit" if per_layer > 0 else "no saving to predict from"))
    if per_layer <= 0:
        return False, None
    fitted, k = _partial_at(target, trials, fits, k, per_layer, budget, log, limit=limit)
    return fitted, (k, per_layer) if not fitted and limit < k < layers else None


def _partial_at(target: Target, trials: Trials, fits, k: int, per_layer: float, budget: int, log, *,
                limit: int | None = None) -> tuple[bool, int]:
    """Compiles full remat on the first k layers; if its estimate is over `budget`, once more with k grown by
    the excess over `per_layer`. Stops beyond `limit` (offload+attn is then expected to recompute less) and
    before every layer (that is the "full" candidate). Returns (whether it fitted: that step is then the last
    compiled, the last k)."""
    layers = target.model_config.num_layers
    for _ in range(2):
        if limit is not None and k > limit:
            log(f"remat auto: full on {k} layers recomputes more than offload+attn on this batch (at most "
                f"{limit} of the {layers} layers do not): offload+attn first")
            return False, k
        if k >= layers:
            return False, k
        if fits("full", k):
            return True, k
        k += max(1, math.ceil((trials.estimates[f"full on {k} layers"] - budget) / per_layer))
    return False, k


# ---------------------------------------------------------------------------------------------- after the load
def fit_allocator(target: Target, execution: ExecutionConfig, host_batch: dict[str, np.ndarray],
                  analysis: dict[str, int], stats: dict[str, int], compile: CompileFn, *,
                  trials: Trials | None = None, log=logger.info) -> Decision:
    """After the load: checks that the step's temporaries (`analysis`: XLA allocates them as ONE buffer per step)
    fit where the device's allocator can still place one buffer (`contiguous_room` of its `stats`), and when they
    do not, re-chooses a leaner step of `remat: auto`'s (`trials` holds its compiles) until one does. Returns
    `execution` unchanged where the device does not report its pool (CPU) or the step fits.

    Why after the load: with a growing allocator (XLA_PYTHON_CLIENT_PREALLOCATE=false) the regions that hold
    the weights are up to about twice their bytes (regions double in size), so a step whose peak fits the
    budget can still find no room for its temp: Gemma-2-9B packed 16k, no remat, runs out of memory at a
    73.54 GiB temp beside 34 GiB of regions holding 18 GiB of weights. The
    remedy keeps the weights where they are (their layout follows the layer loop), so auto's choice is re-made
    within its loop: over unrolled layers (none, or full on k) full remat on more layers, k predicted from full
    remat's per-layer saving (`_partial_remat`'s, else measured the same way: `_full_remat_saving`); in the
    layer scan the policies after it in AUTO_ORDER; each checked by compiling. A policy the user set, or no
    re-choice that fits, raises ExecutionConfigError on key max_memory_gb with the numbers and the fixes."""
    trials = Trials() if trials is None else trials
    room = contiguous_room(stats)
    temp = analysis.get("temp_size_in_bytes", 0)
    if room is None or temp <= room:
        return Decision(execution)
    where = (f"the allocator can place one buffer of {room / GIB:.3f} GiB (pool {stats['pool_bytes'] / GIB:.3f} "
             f"GiB of its {stats['bytes_limit'] / GIB:.3f} GiB limit, largest free block "
             f"{stats.get('largest_free_block_bytes', 0) / GIB:.3f} GiB)")
    log(f"allocator: after the load {where}; the step's temp is {temp / GIB:.3f} GiB")
    ex, layers = execution, target.model_config.num_layers
    unrolled = ex.unrolls(target.mosaic_experts)
    if trials.estimates and unrolled and ex.remat in ("none", "full") and \
            (ex.remat == "none" or (ex.remat_layers or layers) < layers):
        ex, temp = _refit_unrolled(target, ex, host_batch, temp, room, compile, trials, log)
    elif trials.estimates and not unrolled and ex.remat in AUTO_ORDER and ex.remat_layers is None:
        ex, temp = _refit_scan(target, ex, host_batch, temp, room, compile, trials, log)
    if temp <= room:
        return Decision(ex)
    raise ExecutionConfigError(
        "max_memory_gb", f"after the load {where}, below the step's temp ({temp / GIB:.3f} GiB): set "
        "XLA_PYTHON_CLIENT_PREALLOCATE=true (one region for the whole limit) or raise XLA_PYTHON_CLIENT_MEM_FRACTION,"
        " or lower max_memory_gb")


def _refit_unrolled(target: Target, ex: ExecutionConfig, host_batch, temp: int, room: int, compile: CompileFn,
                    trials: Trials, log) -> tuple[ExecutionConfig, int]:
    """`fit_allocator` after auto chose none or full on k layers of the unrolled loop: full remat on more
    layers, k predicted from full remat's per-layer saving and checked by compiling (three tries); returns the
    last (execution, temp)."""
    layers = target.model_config.num_layers
    slope = trials.slope
    if slope is None:  # auto chose "none" outright: measure the saving as `_partial_remat` does
        saving = _full_remat_saving(
            target, trials, lambda n, depth: _shallow_probe(target, compile, trials, ex, n, depth, log),
            lambda: _compile_candidate(target, compile, trials, ex.replace(remat="full", remat_layers=layers), None,
                                       f"full on {layers} layers", lambda e: "probe (per-layer saving of full remat)",
                                       log), log)
        slope = saving[0]
        log(f"remat auto: full remat saves {slope / GIB:.3f} GiB per layer ({saving[1]})")
    k = (ex.remat_layers or 0) if ex.remat == "full" else 0
    last = ex
    for _ in range(3):
        k = min(layers, k + max(1, math.ceil((temp - room) / slope))) if slope > 0 else layers
        last = ex.replace(remat="full", remat_layers=k)
        temp = _refit_compile(target, last, room, compile, trials, log)
        if temp <= room or k == layers:
            break
    return last, temp


def _refit_scan(target: Target, ex: ExecutionConfig, host_batch, temp: int, room: int, compile: CompileFn,
                trials: Trials, log) -> tuple[ExecutionConfig, int]:
    """`fit_allocator` after auto chose a policy of the layer scan: the scan policies after it in auto's order
    (slower and leaner; all keep the stacked weights as placed) in turn, skipping one whose host copies miss
    the host budget, until one's temp fits; returns the last (execution, temp)."""
    order, _ = auto_order(target, host_batch)
    last = ex
    for policy in order[order.index(ex.remat) + 1:]:
        on = host_fit(target, ex.replace(remat=policy), host_batch, log)
        if on is None:
            continue
        last = on
        temp = _refit_compile(target, on, room, compile, trials, log)
        if temp <= room:
            break
    return last, temp


def _refit_compile(target: Target, execution: ExecutionConfig, room: int, compile: CompileFn, trials: Trials,
                   log) -> int:
    """One compile of `fit_allocator`'s re-choice over the loaded weights, recorded as auto's compiles are and
    logged as one line; returns its temp."""
    m = compile(execution).analysis
    temp = m.get("temp_size_in_bytes", 0)
    layers = execution.remat_layers
    name = candidate_name(execution.remat, layers, execution.frozen_weights == "host")  # as `Trials.choice` names it
    trials.estimates[name] = peak_estimate(m)
    trials.compiles.append((execution.remat, layers, target.model_config.num_layers))
    log(f"remat auto: {name:<12} temp {temp / GIB:.3f} GiB -> "
        + ("fits the allocator: chosen" if temp <= room else "does not fit the allocator"))
    return temp
