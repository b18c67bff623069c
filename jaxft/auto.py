"""The automatic choices of a `jaxft.run.Run`, made from compiled memory estimates before any weight moves:
`mesh: auto` (`choose_mesh`), `remat: auto` (`choose_remat`: a policy of `jaxft.remat.AUTO_ORDER`, or full remat on
the first k layers), and after the load the re-choice that fits the allocator's room (`fit_allocator`); with the
estimate they all compare (`peak_estimate`) and the budgets they compare it with (`default_memory_budget`).

`AutoChoices` is a part of `Run` (its base class), kept in its own module: it uses the run's compile
(`Run.compile`, `Run.memory_analysis`) and settings, and sets the run's execution config to what it chose.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import xla_bridge  # no public way to ask whether the backends have started
from jax.experimental import multihost_utils

from jaxft import remat as remat_policies
from jaxft.errors import ConfigError
from jaxft.execution import ExecutionConfig, ExecutionConfigError
from jaxft.remat import AUTO_ORDER, AUTO_PROBE_DEPTH, AUTO_PROBE_LAYERS
from jaxft.sharding import MeshConfig, Placement

logger = logging.getLogger("jaxft.run")  # the run's channel: these lines are the run's choices
GIB = 2**30


# The share of each GPU's memory JAX's allocator may take (XLA_PYTHON_CLIENT_MEM_FRACTION), where the environment
# does not say. JAX's own default, 0.75, leaves a run 59.4 of an H100's 79.2 GiB, where a PyTorch peer may use nearly
# all of it (GPT-OSS-20B's packed 1 x 16384 step cannot place its temporaries beside the weights there). What stays
# outside the pool (the CUDA context, NCCL's buffers, CUDA graphs) fits in the rest, about 4 GiB of an H100.
GPU_MEMORY_FRACTION = 0.95
_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def claim_gpu_memory(environ=None) -> str | None:
    """Sets XLA_PYTHON_CLIENT_MEM_FRACTION to GPU_MEMORY_FRACTION unless the environment already sets it; JAX reads
    it once, when its backends start, so this runs before anything touches a device (`jaxft.train.train`, the
    benchmark's worker). Returns the value in force, or None when JAX's backends had already started and it was
    not set (JAX's default then holds)."""
    environ = os.environ if environ is None else environ
    if _FRACTION_VAR in environ:
        return environ[_FRACTION_VAR]

    if xla_bridge.backends_are_initialized():
        return None
    environ[_FRACTION_VAR] = f"{GPU_MEMORY_FRACTION:.2f}"
    return environ[_FRACTION_VAR]


MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
_NO_LIMIT = 2**60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


def _meminfo(path: Path) -> dict[str, int]:
    """/proc/meminfo's fields in bytes."""
    out = {}
    for line in Path(path).read_text().splitlines():
        key, _, rest = line.partition(":")
        words = rest.split()
        if words and words[0].isdigit():
            out[key.strip()] = int(words[0]) * (1024 if words[1:] == ["kB"] else 1)
    return out


def _cgroup_room(root: Path, proc_cgroup: Path) -> tuple[int, str] | None:
    """(bytes, what) this process's memory cgroup still allows: its limit less what it uses, the inactive page
    cache (which the kernel reclaims before it would kill) not counted as used; None where no limit is set or
    no cgroup file can be read. cgroup v2 (memory.max, memory.current) and v1 (memory.limit_in_bytes,
    memory.usage_in_bytes); the process's own group first, then the root of the mount (a container's)."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":
            base, names = Path(root), ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base, names = Path(root) / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                  "total_inactive_file")
        else:
            continue
        for d in (base / group.lstrip("/"), base):
            try:
                limit_text = (d / names[0]).read_text().strip()
                usage = int((d / names[1]).read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= _NO_LIMIT:
                break  # this hierarchy sets no limit here
            inactive = 0
            try:
                for stat in (d / "memory.stat").read_text().splitlines():
                    key, _, value = stat.partition(" ")
                    if key == names[2]:
                        inactive = int(value)
            except (OSError, ValueError):
                pass
            limit, used = int(limit_text), max(0, usage - inactive)
            return limit - used, f"cgroup limit {limit / GIB:.2f} GiB less {used / GIB:.2f} GiB in use"
    return None


def host_available_memory(meminfo: str | Path = MEMINFO, cgroup_root: str | Path = CGROUP_ROOT,
                          proc_cgroup: str | Path = PROC_CGROUP) -> tuple[int, str]:
    """(bytes, what they are) a new allocation can still take from this host: the kernel's MemAvailable, not
    MemFree (Linux fills free memory with page cache it drops on demand, so MemFree sits near zero on a machine
    with gigabytes to give), capped by the memory cgroup's room where a limit is set (`_cgroup_room`)."""
    info = _meminfo(Path(meminfo))
    total = info.get("MemTotal", 0)
    if "MemAvailable" in info:
        available = info["MemAvailable"]
    else:  # kernels before 3.14: free pages plus the page cache
        available = info.get("MemFree", 0) + info.get("Buffers", 0) + info.get("Cached", 0)
    what = f"MemAvailable {available / GIB:.2f} GiB of MemTotal {total / GIB:.2f} GiB"
    room = _cgroup_room(Path(cgroup_root), Path(proc_cgroup))
    if room is not None and room[0] < available:
        available, what = room[0], f"{room[1]}; {what}"
    return available, what


def default_memory_budget(device=None, *, sharing: int = 1, host: tuple[int, str] | None = None
                          ) -> tuple[int, str]:
    """(bytes, where from) that `remat: auto` may plan a step to use when `max_memory_gb` is not given: the
    device's free memory (allocator limit minus bytes in use) less a margin of max(1 GiB, 5%) for the
    allocator's fragmentation and XLA's workspace. On the CPU, whose device memory is the host's, the host's
    available memory (`host`, default `host_available_memory()`) less the same margin, split over the `sharing`
    CPU devices of this process (each runs its own shard of the step in that memory)."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
        return int(free - max(GIB, 0.05 * free)), f"{device.device_kind} free less max(1 GiB, 5%)"
    free, what = host if host is not None else host_available_memory()
    budget = int(free - max(GIB, 0.05 * free)) // max(1, sharing)
    split = f", split over {sharing} CPU devices" if sharing > 1 else ""
    return budget, f"host available memory: {what}, less max(1 GiB, 5%){split}"


class MemoryBudgetError(ExecutionConfigError):
    """No step fits the device budget. `field` is max_memory_gb, the key that sets the budget; the message
    starts with it only where the user set it (`keyed`): a default budget's refusal names the memory it read."""

    def __init__(self, problem: str, *, keyed: bool):
        self.field, self.problem, self.keyed = "max_memory_gb", problem, keyed
        ConfigError.__init__(self, f"key 'max_memory_gb': {problem}" if keyed else problem)


def host_is_device(device) -> bool:
    """Whether `device`'s memory is the host's (the CPU): there, host offload and weights streamed from host
    memory move bytes within the same memory and cannot make a step fit."""
    return device.platform == "cpu"


# XLA's GPU allocator (BFC) rounds: it hands a whole free chunk to a request when the chunk is less than twice the
# request and the rest is under 128 MiB, and counts the whole chunk as in use: bytes in use before the first step
# exceed the step's arguments by up to 1.5%. A plan counts 2% of the arguments.
ALLOCATOR_SLACK = 0.02


def peak_estimate(analysis: dict[str, int]) -> int:
    """A step's device peak from XLA's compiled memory analysis (JAX 0.11 `CompiledMemoryStats`): arguments
    (weights, LoRA, optimizer state, batch) + outputs + temporaries (activations, residuals, workspace), less
    the outputs aliased to donated arguments (the updated LoRA and optimizer state reuse their inputs' buffers,
    so they are counted once), plus the allocator's rounding of the resident arguments (`ALLOCATOR_SLACK`).
    Host-memory fields (host_*_size_in_bytes) are not device memory."""
    arguments = analysis.get("argument_size_in_bytes", 0)
    return int(arguments + analysis.get("output_size_in_bytes", 0) + analysis.get("temp_size_in_bytes", 0)
               - analysis.get("alias_size_in_bytes", 0) + ALLOCATOR_SLACK * arguments)


STREAMED = " (weights on host)"  # the suffix of a candidate's name whose frozen weights stream (`frozen_weights`)


def candidate_name(policy: str, layers: int | None, streamed: bool = False) -> str:
    """A `remat: auto` candidate's name in `Run.remat_estimates` and the log: the policy, or "full on 2 layers"
    for full remat on the first 2 layers; "offload (weights on host)" with the frozen weights streamed."""
    return (policy if layers is None else f"{policy} on {layers} layers") + (STREAMED if streamed else "")


def contiguous_room(stats: dict[str, int]) -> int | None:
    """Bytes one new buffer can take on a device, from its `memory_stats()`: the larger of the allocator's largest
    free block and what its limit leaves for a new region beside its pool; None when the device does not report a
    pool (the CPU)."""
    if "bytes_limit" not in stats or "pool_bytes" not in stats:
        return None
    return max(int(stats.get("largest_free_block_bytes", 0)), int(stats["bytes_limit"]) - int(stats["pool_bytes"]))


class AutoChoices:
    """`Run`'s automatic choices (see the module docstring); mixed into `jaxft.run.Run`, whose state it reads and
    sets."""

    def _host_memory(self) -> tuple[int, str]:
        """(bytes, what) this host can still give (`host_available_memory`): the CPU device budget's source."""
        return host_available_memory()

    def _budget_is_host_memory(self) -> bool:
        """Whether the default budget is the host's own memory (no `max_memory_gb`, CPU devices): where it is,
        offloading to host memory or streaming weights from it spares nothing, and those candidates are skipped."""
        return self.execution.max_memory_gb is None and host_is_device(self.placement.devices[0])

    def _budget(self) -> tuple[int, str]:
        """(bytes, where from) a step may plan to use on each device: `max_memory_gb`, else the free memory of
        this process's first device less a margin (`default_memory_budget`; CPU devices share the host's
        available memory, so each gets its share); several processes take the smallest of theirs, so that every
        process chooses the same step."""
        if self.execution.max_memory_gb is not None:
            return int(self.execution.max_memory_gb * GIB), "max_memory_gb"
        local = [d for d in self.placement.devices if d.process_index == jax.process_index()]
        on_host = host_is_device(local[0])
        budget, source = default_memory_budget(local[0], sharing=len(local) if on_host else 1,
                                               host=self._host_memory() if on_host else None)
        if jax.process_count() > 1:
            budget = int(np.min(multihost_utils.process_allgather(np.int64(budget))))
            source += f", the smallest of {jax.process_count()} processes"
        return budget, source

    def choose_mesh(self, host_batch: dict[str, np.ndarray], *, log=logger.info) -> MeshConfig:
        """Resolves `mesh: auto` (a no-op for a given mesh): compiles the step from shapes on each mesh of
        `MeshConfig.candidates` (least communication first: pure data parallel, then more fsdp) and keeps the
        first whose estimated per-device peak (`peak_estimate`) fits the budget (`max_memory_gb`, else the
        device's free memory); with `remat: auto` each mesh gets its own remat choice. Logs one line per mesh
        tried and the choice; the chosen step stays compiled. Raises ExecutionConfigError on key max_memory_gb
        when no mesh fits. Must run before `load` (the mesh decides where the weights go)."""
        if not self.mesh.auto:
            return self.mesh
        if self.loaded:
            raise RuntimeError("Run.choose_mesh after Run.load(): choose the mesh before the weights are placed")
        budget, source = self._budget()
        candidates = self.mesh.candidates(len(self.placement.devices))
        log(f"mesh auto: device budget {budget / GIB:.3f} GiB ({source}); candidates in order of communication: "
            f"{', '.join(c.describe() for c in candidates)}")
        base, estimates = self.execution, {}
        for mesh in candidates:
            self.placement = Placement(mesh, self.devices)
            self.graphdef, self._compiled, self._compiled_spec = None, None, None
            if base.remat == "auto":
                self.execution = base
                try:
                    self.choose_remat(host_batch, log=log, budget=(budget, source))
                except ExecutionConfigError:
                    if not self.remat_estimates:  # refused before compiling: no candidate can fit this budget
                        raise
                    estimates[mesh.describe()] = min(self.remat_estimates.values())
                    log(f"mesh auto: {mesh.describe()} no remat policy fits -> does not fit")
                    continue
                estimate = self.remat_choice[1]
            else:
                self.compile(host_batch)
                estimate = peak_estimate(self.memory_analysis())
            estimates[mesh.describe()] = estimate
            fits = estimate <= budget
            log(f"mesh auto: {mesh.describe()} estimated peak {estimate / GIB:.3f} GiB per device -> "
                f"{'fits: chosen' if fits else 'does not fit'}")
            if fits:
                self.mesh = mesh
                return mesh
        self.execution, self._compiled, self._compiled_spec = base, None, None
        self.placement = Placement(candidates[0], self.devices)
        smallest = min(estimates, key=estimates.get)
        raise self._refusal(
            f"no mesh fits in {budget / GIB:.3f} GiB per device ({source}): the smallest estimate is {smallest} at "
            f"{estimates[smallest] / GIB:.3f} GiB", "use more devices, or lower per_device_train_batch_size / "
            "max_seq_length")

    def _refusal(self, what: str, fixes: str) -> "MemoryBudgetError":
        """The error of a budget nothing fits, stated on the key `max_memory_gb` only where the user set it."""
        if self.execution.max_memory_gb is not None:
            return MemoryBudgetError(f"{what}; raise max_memory_gb, {fixes}", keyed=True)
        return MemoryBudgetError(f"{what}; free memory (other processes hold the rest), {fixes}, or set "
                                 "max_memory_gb (GiB per device) to plan for more than this", keyed=False)

    def choose_remat(self, host_batch: dict[str, np.ndarray], *, log=logger.info,
                     budget: tuple[int, str] | None = None) -> str:
        """Resolves `remat: auto` (a no-op for any other policy): compiles the step from shapes for each policy
        of `jaxft.remat.AUTO_ORDER` (fastest expected first), estimates its device peak (`peak_estimate`) and
        keeps the first within `max_memory_gb` (default `default_memory_budget`); between "none" and the next
        policy it tries full remat on the first k layers (`_partial_remat`) while k layers recompute less than
        offload+attn on this batch (`jaxft.remat.partial_full_limit`), else after offload+attn if that does not
        fit. LEAN_ATTN moves after offload (one line) where its host copies cost more than the attention forward
        they spare (`_auto_order`). Every compile logs one line (what, its estimate, and why it was compiled);
        slower candidates than the choice are not compiled. The chosen step stays compiled; `remat_compiles` lists
        what was compiled.
        Raises ExecutionConfigError (one line, with the smallest estimate) when nothing fits, at once when the
        budget cannot hold the frozen weights alone. Where the budget is the host's own memory (CPU devices, no
        max_memory_gb: `_budget_is_host_memory`), candidates that offload to the host or stream the weights
        from it are skipped: they would move bytes within the same memory. `budget`: (bytes, where from) to plan
        in (`choose_mesh` passes its own); None: `_budget()`.
        Must run before `load`: the policy decides the layer loop, hence the weight layout."""
        base = original = self.execution
        if base.remat != "auto":
            return base.remat
        if self.loaded:
            raise RuntimeError("Run.choose_remat after Run.load(): choose the policy before the weights are placed")
        budget, source = budget or self._budget()
        order, why = self._auto_order(host_batch)
        on_host = self._budget_is_host_memory()
        if on_host:
            order, why = tuple(p for p in order if not remat_policies.parse(p).offloads), None
        log(f"remat auto: device budget {budget / GIB:.2f} GiB ({source}); candidates in order of expected speed: "
            f"{', '.join(order)}" + (" (host-offloading policies skipped: the device's memory is the host's)"
                                     if on_host else ""))
        if why:
            log(why)
        self._refuse_at_once(budget, source, on_host)
        self._auto_seconds, self.remat_estimates, self.remat_probes, self.remat_compiles = 0.0, {}, {}, []

        def fits(policy: str, layers: int | None = None, *, probe: bool = False) -> bool:
            """Compiles `policy` (on the first `layers` layers) at the model's depth and says whether it fits; a
            fitting probe is measured, not chosen, so it neither logs "chosen" nor ends the compile count."""
            name = candidate_name(policy, layers, base.frozen_weights == "host")
            on = self._host_fit(base.replace(remat=policy), host_batch, log)
            if on is None:
                return False
            estimate = self.remat_estimates[name] = self._compile_candidate(
                self, on, host_batch, policy, layers, name,
                lambda e: ("fits (probe)" if probe else "fits: chosen") if e <= budget else "does not fit", log)
            if estimate <= budget and not probe:
                self.compile_seconds = self._auto_seconds
            return estimate <= budget

        def shallow(layers: int, depth: int) -> int:
            return self._shallow_probe(base, host_batch, layers, depth, log)

        segments = host_batch.get("segment_ids", np.ones_like(host_batch["input_ids"]))
        limit = remat_policies.partial_full_limit(remat_policies.recompute_work(self.model_config, segments))
        # The weights on the device first; streamed from host memory (one device) when nothing fits there or
        # `frozen_weights: host` asks for it. Streamed candidates run in the layer scan: no full remat on the first k
        # layers (unrolled).
        streams = len(self.placement.devices) == 1 and not on_host
        placements = {"device": ["device"], "host": ["host"]}.get(
            base.frozen_weights, ["device", "host"] if streams else ["device"])
        for weights in placements:
            if weights == "host" and original.frozen_weights == "auto":
                log("remat auto: no policy fits with the frozen weights on the device; the same candidates with "
                    "them streamed from pinned host memory (frozen_weights host)")
            base = base.replace(frozen_weights=weights)
            deferred = None  # full remat on the first k layers, passed over for offload+attn: (k, per-layer saving)
            for policy in order:
                if policy == "full" and deferred is not None and self._partial_at(fits, *deferred, budget, log)[0]:
                    return self.execution.remat  # offload+attn did not fit; k layers beat full remat on all of them
                if fits(policy):
                    rest = order[order.index(policy) + 1:]
                    if rest:
                        log(f"remat auto: chose {policy}{STREAMED if weights == 'host' else ''} (not compiled: "
                            f"{', '.join(rest)}, expected slower)")
                    return policy
                if policy == "none" and weights == "device":
                    chosen, deferred = self._partial_remat(fits, shallow, budget, limit, log)
                    if chosen:
                        return self.execution.remat
        self.execution, self._compiled, self._compiled_spec = original, None, None
        smallest = min(self.remat_estimates, key=self.remat_estimates.get)
        raise self._refusal(f"no remat policy fits in {budget / GIB:.3f} GiB ({source}): the smallest estimate is "
                            f"{smallest} at {self.remat_estimates[smallest] / GIB:.3f} GiB",
                            "or lower per_device_train_batch_size / max_seq_length")

    def _refuse_at_once(self, budget: int, source: str, on_host: bool) -> None:
        """Raises `MemoryBudgetError` before any compile where a default budget (no max_memory_gb) cannot hold a
        step: it is not positive, or one device would hold the frozen weights (CPU: always, nothing streams) and
        they alone exceed it. A budget the user set is tried candidate by candidate, to name the smallest."""
        if self.execution.max_memory_gb is not None:
            return
        self.remat_estimates = {}
        if budget <= 0:
            raise self._refusal(f"the memory left for the step is {budget / GIB:.3f} GiB per device ({source})",
                                "or lower per_device_train_batch_size / max_seq_length")
        if len(self.placement.devices) == 1 and (on_host or self.execution.frozen_weights == "device"):
            weights = self.streamed_weight_bytes()
            if weights > budget:
                raise self._refusal(f"the frozen weights alone take {weights / GIB:.3f} GiB, over the "
                                    f"{budget / GIB:.3f} GiB the step may use ({source})",
                                    "load_in_4bit, use more devices (mesh with fsdp), or a smaller model")

    def _copies_pay(self, host_batch: dict[str, np.ndarray]) -> tuple[bool, float, float]:
        """`jaxft.remat.attention_copies_pay` on one micro-batch of `host_batch` at the run's activation dtype."""
        segments = host_batch.get("segment_ids", np.ones_like(host_batch["input_ids"]))
        rows = segments.shape[0] // self.accumulation
        return remat_policies.attention_copies_pay(self.model_config, segments[:rows], jnp.dtype(self.dtype).itemsize)

    def _auto_order(self, host_batch: dict[str, np.ndarray]) -> tuple[tuple[str, ...], str | None]:
        """(`jaxft.remat.AUTO_ORDER` for this batch, a line saying why it differs or None). Where LEAN_ATTN's host
        copies (the attention's output and statistics) are expected to cost more than the attention forward they
        spare the backward (`_copies_pay`: short documents, narrow windows, short rows), it moves after offload:
        full and offload, which recompute the attention, are then expected faster, and it stays for a device
        neither fits (it keeps about offload's device memory, a little less)."""
        pays, saved, copies = self._copies_pay(host_batch)
        if pays:
            return AUTO_ORDER, None
        lean = remat_policies.LEAN_ATTN
        return tuple(p for p in AUTO_ORDER if p != lean) + (lean,), (
            f"remat auto: {lean} tried after offload: its attention copies to host cost about {copies / 1e12:.1f} "
            f"TFLOP of matmul time a step, more than the attention forward they spare ({saved / 1e12:.1f} TFLOP)")

    def _host_fit(self, ex: ExecutionConfig, host_batch: dict[str, np.ndarray], log) -> ExecutionConfig | None:
        """`ex` if what its policy offloads, with the streamed weights under `frozen_weights: host`, fits the host
        budget (`host_memory_gb`, else the machine's memory less a margin: `jaxft.remat.default_host_budget`); for
        "offload" (weights on the device) that does not fit, `ex` in nested blocks sized to
        the budget (`remat_block: auto`); None (logged) for another policy that does not fit. The bytes are those of
        the micro-batch this process holds (several local devices' shards together)."""
        streamed = self.streamed_weight_bytes() if ex.frozen_weights == "host" else 0
        offloads = remat_policies.parse(ex.remat).offloads
        if not offloads and not streamed:
            return ex
        rows, seq = host_batch["input_ids"].shape[0] // self.accumulation, host_batch["input_ids"].shape[-1]
        itemsize = jnp.dtype(self.dtype).itemsize
        need = streamed + (remat_policies.offloaded_bytes(ex.layer_policy(self.model_config, rows, seq, itemsize),
                                                          self.model_config, rows, seq, itemsize, ex.mlp_chunk_size)
                           if offloads else 0)
        host = ex.host_budget_bytes()
        if need <= host:
            return ex
        if ex.remat == "offload" and ex.remat_block is None and not streamed:
            nested = ex.replace(remat_block="auto")
            k = nested.block_for(self.model_config, rows, seq, itemsize)
            log(f"remat auto: offload's layer inputs need {need / GIB:.2f} GiB of host memory, over the host budget "
                f"{host / GIB:.2f} GiB: offload in nested blocks of {k} layers (remat_block auto)")
            return nested
        what = "offloads" + (f" (with {streamed / GIB:.2f} GiB of streamed weights)" if streamed else "")
        log(f"remat auto: {ex.remat:<12} {what} {need / GIB:.2f} GiB, over the host budget {host / GIB:.2f} GiB "
            "-> does not fit (host)")
        return None

    @property
    def remat_choice(self) -> tuple[str, int] | None:
        """What `remat: auto` chose, named as in `remat_estimates` ("full on 2 layers" for full remat on the first
        2 layers), and its estimated peak bytes; None when auto has not run."""
        if not self.remat_estimates:
            return None
        name = candidate_name(self.execution.remat, self.execution.remat_layers, self.execution.frozen_weights == "host")
        return name, self.remat_estimates[name]

    def _compile_candidate(self, run: "AutoChoices", base: ExecutionConfig, host_batch: dict[str, np.ndarray],
                           policy: str, layers: int | None, name: str, verdict, log) -> int:
        """`remat: auto`'s one compile: `policy` (on the first `layers` layers) over `base` on `run` (this run or a
        shallow copy), recorded in `remat_compiles` and `_auto_seconds`, logged as one line ending in
        `verdict(estimate)`; returns the estimate (`peak_estimate`)."""
        run.execution = base.replace(remat=policy, remat_layers=layers)  # (base may carry remat_block: _host_fit)
        run.compile(host_batch)
        self._auto_seconds += run.compile_seconds
        self.remat_compiles.append((policy, layers, run.model_config.num_layers))
        m = run.memory_analysis()
        estimate = peak_estimate(m)
        log(f"remat auto: {name:<12} estimated peak {estimate / GIB:.3f} GiB (arguments "
            f"{m.get('argument_size_in_bytes', 0) / GIB:.3f} + outputs {m.get('output_size_in_bytes', 0) / GIB:.3f}"
            f" + temp {m.get('temp_size_in_bytes', 0) / GIB:.3f} - aliased {m.get('alias_size_in_bytes', 0) / GIB:.3f}"
            f" + allocator slack {ALLOCATOR_SLACK * m.get('argument_size_in_bytes', 0) / GIB:.3f})"
            f" -> {verdict(estimate)}")
        return estimate

    def _shallow_probe(self, base: ExecutionConfig, host_batch: dict[str, np.ndarray], layers: int, depth: int,
                       log) -> int:
        """Full remat on the first `layers` layers of a `depth`-layer copy of the model (`_shallow`), recorded in
        `remat_probes`; returns its estimate."""
        name = f"full on {layers} of a {depth}-layer copy"
        self.remat_probes[name] = self._compile_candidate(self._shallow(depth), base, host_batch, "full", layers,
                                                          name, lambda e: "probe (per-layer saving of full remat)", log)
        return self.remat_probes[name]

    def _full_remat_saving(self, shallow, everywhere, log) -> tuple[float, str] | None:
        """(bytes full remat saves per layer, how it was measured): from `shallow(layers, depth)` (full remat on
        `AUTO_PROBE_LAYERS` of the first `AUTO_PROBE_DEPTH` layers of a shallow copy, see `_partial_remat`), or,
        for a model no deeper than the copy or with no valid copy, from `everywhere()` (the estimate of full
        remat on every layer at full depth against "none"'s; None: not measured, and neither is the saving)."""
        layers = self.model_config.num_layers
        depth, (few, more) = AUTO_PROBE_DEPTH, AUTO_PROBE_LAYERS
        probing = layers > depth
        if probing:
            try:
                self.model_config.first_layers(depth)
            except ConfigError as e:  # e.g. a MoE model whose first layers are all dense
                log(f"remat auto: no {depth}-layer copy of this model ({e}); full on every layer is compiled instead")
                probing = False
        if probing:
            return ((shallow(few, depth) - shallow(more, depth)) / (more - few),
                    f"full on {few} and on {more} of a {depth}-layer copy")
        full = everywhere()
        if full is None:
            return None
        return (self.remat_estimates["none"] - full) / layers, f"full on all {layers} layers"

    def _partial_remat(self, fits, shallow, budget: int, limit: int, log) -> tuple[bool, tuple[int, float] | None]:
        """After "none" does not fit: full remat on the first k layers only (`remat_layers`), the smallest k that
        fits by full remat's per-layer saving, then checked by compiling k itself at the model's depth (once more
        with k grown by the remaining excess if the estimate was short). Models of 4 layers or more (below, one
        layer is within the noise) whose loop can unroll (not an MoE model on the Mosaic GPU expert kernels:
        `unrolled`). Taken only while k <= `limit` (`jaxft.remat.partial_full_limit` on this batch): beyond it
        offload+attn (next in `AUTO_ORDER`), which recomputes every layer's projections and MLP but no attention,
        is expected to recompute less. Returns (whether a k fitted: the step is then compiled and `execution` holds
        it, (k, per-layer saving) when k was passed over for being beyond `limit`, for `_partial_at` should
        offload+attn not fit).

        The per-layer saving is measured on a shallow copy of the model (`_shallow`: its first
        `jaxft.remat.AUTO_PROBE_DEPTH` layers, compiled from shapes), as the difference between full remat on
        two numbers of its first layers (`AUTO_PROBE_LAYERS`), per layer: the quantity k needs, in the program
        partial remat runs, at a few layers' compile time instead of full remat on every layer at full depth.
        Only a slope is taken from the copy: a policy's peak is close to affine in the depth, but the intercept
        a shallow program shows is not the deep one's (XLA reuses more buffers in a deep program), and what
        does not grow with the rematerialised layers (full remat's smaller cross-entropy chunk) cancels in the
        difference. Models no deeper than the copy (or with no valid copy) measure it from full remat on every
        layer at full depth."""
        layers = self.model_config.num_layers
        none = self.remat_estimates["none"]
        if layers < 4 or self.execution.layer_loop == "scan":  # remat_layers needs the unrolled loop
            return False, None
        if self.execution.layer_loop == "auto" and self.mosaic_experts:  # auto scans these (`unrolled`)
            log("remat auto: no full remat on the first layers only (it needs unrolled layers, whose Mosaic GPU "
                "expert kernels compile for minutes); offload+attn is next")
            return False, None
        saving = self._full_remat_saving(
            shallow, lambda: self.remat_estimates[f"full on {layers} layers"] if fits("full", layers, probe=True)
            else None, log)
        if saving is None:
            return False, None
        per_layer, how = saving
        self._remat_slope = per_layer
        k = math.ceil((none - budget) / per_layer) if per_layer > 0 else layers
        log(f"remat auto: full remat saves {per_layer / GIB:.3f} GiB per layer ({how}); none is "
            f"{(none - budget) / GIB:.3f} GiB over the budget -> "
            + (f"full on {k} layers predicted to fit" if per_layer > 0 else "no saving to predict from"))
        if per_layer <= 0:
            return False, None
        fitted, k = self._partial_at(fits, k, per_layer, budget, log, limit=limit)
        return fitted, (k, per_layer) if not fitted and limit < k < layers else None

    def _partial_at(self, fits, k: int, per_layer: float, budget: int, log, *,
                    limit: int | None = None) -> tuple[bool, int]:
        """Compiles full remat on the first k layers; if its estimate is over `budget`, once more with k grown by
        the excess over `per_layer`. Stops beyond `limit` (offload+attn is then expected to recompute less) and
        before every layer (that is the "full" candidate). Returns (whether it fitted: that step is then compiled,
        the last k)."""
        layers = self.model_config.num_layers
        for _ in range(2):
            if limit is not None and k > limit:
                log(f"remat auto: full on {k} layers recomputes more than offload+attn on this batch (at most "
                    f"{limit} of the {layers} layers do not): offload+attn first")
                return False, k
            if k >= layers:
                return False, k
            if fits("full", k):
                return True, k
            k += max(1, math.ceil((self.remat_estimates[f"full on {k} layers"] - budget) / per_layer))
        return False, k

    def _shallow(self, depth: int) -> "AutoChoices":
        """A copy of this run whose model is its first `depth` layers (same widths, embeddings and head), with no
        state, for compiles from shapes alone (`_partial_remat`'s probes): it shares this run's placement,
        optimizer and settings, and compiling it leaves this run's graphdef, compiled step and execution as they
        are. Never loaded (the checkpoint holds every layer)."""
        other = copy.copy(self)
        other.model_config = self.model_config.first_layers(depth)
        other.graphdef = other.lora = other.frozen = other.opt_state = None
        other._compiled = other._compiled_spec = other._eval_fn = None
        other.remat_estimates, other.remat_probes, other.remat_compiles = {}, {}, []
        return other

    def fit_allocator(self, host_batch: dict[str, np.ndarray], *, stats: dict[str, int] | None = None,
                      log=logger.info) -> None:
        """After `load`: checks that the step's temporaries (XLA allocates them as ONE buffer per step) fit where the
        device's allocator can still place one buffer (`contiguous_room`), and when they do not, re-chooses a
        leaner step of `remat: auto`'s until one does. A no-op where the device does not report its pool (CPU) or
        the step fits.

        Why after the load: with a growing allocator (XLA_PYTHON_CLIENT_PREALLOCATE=false) the regions that hold
        the weights are up to about twice their bytes (regions double in size), so a step whose peak fits the
        budget can still find no room for its temp: Gemma-2-9B packed 16k, no remat, runs out of memory at a
        73.54 GiB temp beside 34 GiB of regions holding 18 GiB of weights. The
        remedy keeps the weights where they are (their layout follows the layer loop), so auto's choice is re-made
        within its loop: over unrolled layers (none, or full on k) full remat on more layers, k predicted from full
        remat's per-layer saving (`_partial_remat`'s, else measured the same way: `_full_remat_saving`); in the
        layer scan the policies after it in AUTO_ORDER; each checked by compiling. A policy the user set, or no
        re-choice that fits, raises ExecutionConfigError on key max_memory_gb with the numbers and the fixes."""
        if not self.loaded:
            raise RuntimeError("Run.fit_allocator before Run.load(): the allocator's pool is known once the weights "
                               "are placed")
        if stats is None:
            local = [d for d in self.placement.devices if d.process_index == jax.process_index()]
            stats = local[0].memory_stats() or {}
        room = contiguous_room(stats)
        if room is None:
            return
        if not self.compiled_for(host_batch):
            self.compile(host_batch)
        temp = self.memory_analysis().get("temp_size_in_bytes", 0)
        if temp <= room:
            return
        where = (f"the allocator can place one buffer of {room / GIB:.3f} GiB (pool {stats['pool_bytes'] / GIB:.3f} "
                 f"GiB of its {stats['bytes_limit'] / GIB:.3f} GiB limit, largest free block "
                 f"{stats.get('largest_free_block_bytes', 0) / GIB:.3f} GiB)")
        log(f"allocator: after the load {where}; the step's temp is {temp / GIB:.3f} GiB")
        ex, layers = self.execution, self.model_config.num_layers
        if self.remat_estimates and self.unrolled and ex.remat in ("none", "full") and \
                (ex.remat == "none" or (ex.remat_layers or layers) < layers):
            temp = self._refit_unrolled(host_batch, temp, room, log)
        elif self.remat_estimates and not self.unrolled and ex.remat in AUTO_ORDER and ex.remat_layers is None:
            temp = self._refit_scan(host_batch, temp, room, log)
        if temp <= room:
            return
        raise ExecutionConfigError(
            "max_memory_gb", f"after the load {where}, below the step's temp ({temp / GIB:.3f} GiB): set "
            "XLA_PYTHON_CLIENT_PREALLOCATE=true (one region for the whole limit) or raise XLA_PYTHON_CLIENT_MEM_FRACTION,"
            " or lower max_memory_gb")

    def _refit_unrolled(self, host_batch: dict[str, np.ndarray], temp: int, room: int, log) -> int:
        """`fit_allocator` after auto chose none or full on k layers of the unrolled loop: full remat on more
        layers, k predicted from full remat's per-layer saving and checked by compiling (three tries); returns the
        last temp."""
        ex, layers = self.execution, self.model_config.num_layers
        slope = self._remat_slope
        if slope is None:  # auto chose "none" outright: measure the saving as `_partial_remat` does
            saving = self._full_remat_saving(
                lambda n, depth: self._shallow_probe(ex, host_batch, n, depth, log),
                lambda: self._compile_candidate(self, ex, host_batch, "full", layers, f"full on {layers} layers",
                                                lambda e: "probe (per-layer saving of full remat)", log), log)
            slope = saving[0]
            log(f"remat auto: full remat saves {slope / GIB:.3f} GiB per layer ({saving[1]})")
        k = (ex.remat_layers or 0) if ex.remat == "full" else 0
        for _ in range(3):
            k = min(layers, k + max(1, math.ceil((temp - room) / slope))) if slope > 0 else layers
            temp = self._refit_compile(ex.replace(remat="full", remat_layers=k), host_batch, room, log)
            if temp <= room or k == layers:
                break
        return temp

    def _refit_scan(self, host_batch: dict[str, np.ndarray], temp: int, room: int, log) -> int:
        """`fit_allocator` after auto chose a policy of the layer scan: the scan policies after it in auto's order
        (slower and leaner; all keep the stacked weights as placed) in turn, skipping one whose host copies miss
        the host budget, until one's temp fits; returns the last temp."""
        ex = self.execution
        order, _ = self._auto_order(host_batch)
        for policy in order[order.index(ex.remat) + 1:]:
            on = self._host_fit(ex.replace(remat=policy), host_batch, log)
            if on is None:
                continue
            temp = self._refit_compile(on, host_batch, room, log)
            if temp <= room:
                break
        return temp

    def _refit_compile(self, execution: ExecutionConfig, host_batch: dict[str, np.ndarray], room: int, log) -> int:
        """One compile of `fit_allocator`'s re-choice over the loaded weights, recorded as auto's compiles are and
        logged as one line; returns its temp."""
        self.execution = execution
        self.compile(host_batch)
        m = self.memory_analysis()
        temp = m.get("temp_size_in_bytes", 0)
        layers = execution.remat_layers
        name = candidate_name(execution.remat, layers)
        self.remat_estimates[name] = peak_estimate(m)
        self.remat_compiles.append((execution.remat, layers, self.model_config.num_layers))
        log(f"remat auto: {name:<12} temp {temp / GIB:.3f} GiB -> "
            + ("fits the allocator: chosen" if temp <= room else "does not fit the allocator"))
        return temp
