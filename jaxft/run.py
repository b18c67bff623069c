"""`Run`: the one recipe behind `jaxft-train`, the Python API, the benchmarks and the ablation script.

    run = Run.from_config(train_config, total_steps)      # or Run(model_dir, lora=..., execution=..., optim=...)
    run.compile(host_batch)        # optional, before load(): compiled from shapes, no weight on the device yet
    run.choose_remat(host_batch)   # remat "auto": compiles candidates from shapes, keeps the fastest that fits
    run.load()                     # HF weights -> LoRA -> split by type -> per-layer buffers? -> placed
    metrics = run.step(host_batch, step_index)                 # one optimizer update (the compiled step)
    loss_sum, count = run.evaluate(host_batches)
    run.export_adapter(dir); run.export_merged(dir)

What it holds: the model's `graphdef`, the trainable `lora` state and the optimizer state (donated to each
step: updated in place), the `frozen` state (base weights, LoRA scales; read only), the run's RNG key.
Execution settings (attention kernel, remat, layer loop, CE chunk, compiler options) come from one
`ExecutionConfig`; the model itself holds only parameters and math.

Compiling before loading matters on a GPU: XLA's autotuner allocates scratch while it compiles, and with the
weights resident that transient can exceed the training peak, which the allocator's peak statistic then hides.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bridge
from jaxft.config import SPARSE_MLPS, ConfigError, ModelConfig
from jaxft.execution import ExecutionConfig, ExecutionConfigError
from jaxft import remat as remat_policies
from jaxft.remat import AUTO_ORDER, AUTO_PROBE_DEPTH, AUTO_PROBE_LAYERS
from jaxft.lora import LoraConfig, apply_lora, target_names
from jaxft.models.decoder import abstract_model, model_class
from jaxft.sharding import MeshConfig, Placement
from jaxft.train.optim import OptimConfig
from jaxft.train.step import (make_eval_step, make_train_step, restack_layers, split_model, stack_micro_batches,
                              unstack_layers)


logger = logging.getLogger("jaxft.run")
GIB = 2**30


def default_memory_budget(device=None) -> tuple[int, str]:
    """(bytes, where from) that `remat: auto` may plan a step to use when `max_memory_gb` is not given: the
    device's free memory (allocator limit minus bytes in use) less a margin of max(1 GiB, 5%) for the
    allocator's fragmentation and XLA's workspace. On the CPU, whose device memory is the host's, the host's
    available physical memory less the same margin."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        free, source = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), f"{device.device_kind} free"
    else:
        free, source = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host available memory"
    return int(free - max(GIB, 0.05 * free)), f"{source} less max(1 GiB, 5%)"


# XLA's GPU allocator (BFC) rounds: it hands a whole free chunk to a request when the chunk is less than twice the
# request and the rest is under 128 MiB, and counts the whole chunk as in use. Measured on the H200 (docs/benchmarks.md
# section 17): bytes in use before the first step exceeded the step's arguments by 0.15-1.5% (Gemma-3-12B unrolled:
# 0.34 GiB over 22.65 GiB, which took a 36.95 GiB estimate to a 37.29 GiB peak). A plan counts 2% of the arguments.
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


def candidate_name(policy: str, layers: int | None) -> str:
    """A `remat: auto` candidate's name in `Run.remat_estimates` and the log: the policy, or "full on 2 layers"
    for full remat on the first 2 layers."""
    return policy if layers is None else f"{policy} on {layers} layers"


def contiguous_room(stats: dict[str, int]) -> int | None:
    """Bytes one new buffer can take on a device, from its `memory_stats()`: the larger of the allocator's largest
    free block and what its limit leaves for a new region beside its pool; None when the device does not report a
    pool (the CPU)."""
    if "bytes_limit" not in stats or "pool_bytes" not in stats:
        return None
    return max(int(stats.get("largest_free_block_bytes", 0)), int(stats["bytes_limit"]) - int(stats["pool_bytes"]))


def _abstract(tree):
    """Shapes and (canonical: int64 host arrays become int32 on the device) dtypes of a tree of arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jax.dtypes.canonicalize_dtype(x.dtype)), tree)


@dataclasses.dataclass
class Run:
    """See the module docstring. Build with `Run.from_config` or directly; nothing is read until used."""

    model_path: str | Path
    lora_config: LoraConfig
    execution: ExecutionConfig = dataclasses.field(default_factory=ExecutionConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    total_steps: int = 1
    dtype: str = "bfloat16"
    seed: int = 0
    accumulation: int = 1
    devices: Any = None
    quant_config: Any = None  # jaxft.quant.QuantConfig: frozen linears in 4 bits (QLoRA); None: as stored
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    def __post_init__(self):
        self.model_path = Path(self.model_path).expanduser()
        self.model_config = ModelConfig.from_hf(bridge.read_config(self.model_path),
                                                source=str(self.model_path / "config.json"))
        self.optimizer, self.schedule = self.optim.build(self.total_steps)
        self.placement = Placement(self.mesh, self.devices)
        self.rng = jax.random.key(self.seed)
        self.graphdef = self.lora = self.frozen = self.opt_state = None
        self._compiled = None
        self._compiled_spec = None
        self._eval_fn = None
        self.compile_seconds = 0.0
        self.remat_estimates: dict[str, int] = {}  # remat "auto": candidate -> estimated peak bytes
        # remat "auto": what it compiled, in order: (policy, remat_layers, model depth); a depth below the model's
        # is a shallow probe (`_shallow`), whose estimate is in `remat_probes`, not `remat_estimates`
        self.remat_compiles: list[tuple[str, int | None, int]] = []
        self.remat_probes: dict[str, int] = {}
        self._remat_slope: float | None = None  # remat "auto": bytes full remat saves per layer (`_partial_remat`)
        self._auto_seconds = 0.0  # remat "auto": seconds of its compiles so far (`_compile_candidate`)

    @classmethod
    def from_config(cls, config, total_steps: int, *, devices=None) -> "Run":
        """The run a `jaxft.train.TrainConfig` describes (its validated model, LoRA, execution and optimiser
        parts)."""
        return cls(model_path=config.model.path, lora_config=config.lora, execution=config.execution,
                   optim=config.optim, total_steps=total_steps, dtype=config.model.dtype, seed=config.seed,
                   accumulation=config.gradient_accumulation_steps, devices=devices, quant_config=config.model.quant,
                   mesh=config.mesh_config)

    # ------------------------------------------------------------------ building the state
    @property
    def unrolled(self) -> bool:
        """Whether the layers run unrolled (`ExecutionConfig.resolved_layer_loop`), except that `layer_loop: auto`
        scans an MoE model whose experts run the Mosaic GPU grouped matmul when nothing needs the unrolled loop:
        every call site of a Mosaic GPU kernel is compiled on its own, so 24 unrolled GPT-OSS-20B layers compiled
        for over 4 minutes on the H200 (docs/benchmarks.md section 19), where the scan compiles each kernel once."""
        ex = self.execution
        if ex.resolved_layer_loop != "unroll":
            return False
        return not (ex.layer_loop == "auto" and not ex.needs_unrolled_layers and self.mosaic_experts)

    @property
    def layer_loop(self) -> str:
        """The layer loop this run uses, "unroll" or "scan" (`unrolled`), as the configs spell it."""
        return "unroll" if self.unrolled else "scan"

    @property
    def mosaic_experts(self) -> bool:
        """Whether the model has expert layers whose grouped matmul resolves to the Mosaic GPU kernels here."""
        from kernels_pallas.grouped_matmul import implementation_for

        if not set(SPARSE_MLPS) & set(self.model_config.layer_mlps):
            return False
        device = self.placement.devices[0]
        return implementation_for(self.execution.grouped_matmul_implementation, self.dtype, device) == "pallas_mosaic"

    def _abstract_split(self):
        from jaxft.quant.weights import abstract_quantize

        def build():
            model = model_class(self.model_config)(self.model_config, dtype=jnp.dtype(self.dtype),
                                                   rngs=nnx.Rngs(0))
            abstract_quantize(model, self.model_path, self.quant_config)
            return apply_lora(model, self.lora_config, seed=self.seed)
        return split_model(nnx.eval_shape(build))

    def check_targets(self) -> list[str]:
        """The HF module names the LoRA config adapts (raises `LoraConfigError` when a target matches nothing);
        reads no weights."""
        return target_names(abstract_model(self.model_config, dtype=jnp.float32), self.lora_config)

    def abstract_state(self):
        """(graphdef, lora, frozen) as shapes: what `load` would build, with nothing allocated."""
        graphdef, lora, frozen = self._abstract_split()
        return graphdef, lora, unstack_layers(frozen) if self.unrolled else frozen

    def load(self) -> "Run":
        """Reads the weights, applies LoRA (seeded), splits by variable type and places the state."""
        from jaxft.io import from_pretrained

        if self.execution.remat == "auto":
            raise RuntimeError("Run.load() with remat 'auto': call run.choose_remat(batch) or run.compile(batch) "
                               "first (the chosen policy decides the weight layout)")
        # One device: whole arrays. A mesh: each weight is read shard by shard into its place (jaxft.io); 4-bit
        # weights are quantised on one device and then placed (their variable type has no logical axes yet).
        mesh = self.placement if len(self.placement.devices) > 1 and self.quant_config is None else None
        model = apply_lora(from_pretrained(self.model_path, self.dtype, quant_config=self.quant_config, mesh=mesh),
                           self.lora_config, seed=self.seed)
        graphdef, lora, frozen = split_model(model)
        del model  # its LoRA buffers are donated to the step; its stacked weights go as they are split
        return self._adopt(graphdef, lora, frozen)

    def init_random(self) -> "Run":
        """Like `load`, with random weights instead of the checkpoint's (`jaxft.models.decoder.init_model`:
        normal(0, 0.02) linears and embeddings, unit norms; seeded by `seed`): a run of a model shape that has no
        weights on disk, e.g. memory and speed at real sizes (scripts/max_context.py, scripts/bench_scaling.py).
        Not for a 4-bit base (its codes come from the checkpoint's weights).

        The weights are made where they live: one compiled program draws every array straight into its place on
        the mesh (`out_shardings`), so a device holds only its shards of the frozen weights, never the whole
        model (a 70B model's 131 GiB of bf16 weights, split over 8 GPUs by FSDP, fit where made whole on one they
        would not). JAX's threefry is partitionable (`jax_threefry_partitionable`, on by default since 0.5), so
        each shard's draws equal the matching slice of the whole array's: the same seed gives the same weights on
        every mesh (tests/test_sharding.py)."""
        if self.execution.remat == "auto":
            raise RuntimeError("Run.init_random() with remat 'auto': call run.choose_remat(batch) or "
                               "run.compile(batch) first (the chosen policy decides the weight layout)")
        if self.quant_config is not None:
            raise ValueError("Run.init_random() with a 4-bit base (quant_config): random 4-bit codes are not "
                             "supported; use load()")
        graphdef, make = self.random_state_program()
        return self._adopt(graphdef, *make())

    def random_state_program(self):
        """(graphdef, program): the jitted program `init_random` runs, returning the (lora, frozen) states with every
        array made in its place on the mesh (`out_shardings`). Compiled for an H200 (scripts/deviceless), it keeps no
        temporaries: XLA fuses each array's threefry draws, normal transform and cast into the kernel that writes it
        (Llama-3.1-8B on one device: 15.1 GiB of outputs, 0 of temporaries; 70B over 8: 17.2 GiB per device). XLA's
        CPU backend runs threefry as a loop over [shard]-sized uint32 buffers instead: a 70B init over 8 CPU
        devices would keep 75 GiB of them per device; the CPU makes tiny models only. Lower and compile it to see
        its memory per device."""
        from jaxft.models.decoder import init_model

        graphdef, lora, frozen = self._abstract_split()

        def make():
            model = init_model(self.model_config, dtype=jnp.dtype(self.dtype), seed=self.seed)
            return split_model(apply_lora(model, self.lora_config, seed=self.seed))[1:]
        return graphdef, jax.jit(make, out_shardings=(self.placement.shardings(lora), self.placement.shardings(frozen)))

    def _adopt(self, graphdef, lora, frozen) -> "Run":
        """Takes a model's split state (`split_model`): per-layer buffers where the layers run unrolled, each
        array placed on the mesh, a fresh optimizer state (the end of `load` and `init_random`)."""
        if self.unrolled:  # a stacked array at a time is sliced, then freed
            frozen = unstack_layers(frozen, delete_source=True)
        self.graphdef = graphdef
        self.lora, self.frozen = self.placement.place(lora), self.placement.place(frozen)
        self.opt_state = self.placement.place_like(self.optimizer.init(self.lora), self.lora)
        return self

    def set_state(self, lora, opt_state=None) -> None:
        """Replaces the trainable state (a restored checkpoint, or a fresh LoRA init for another task); without
        `opt_state`, a fresh optimizer state for `lora`.

        The old state is released BEFORE the new one is placed: the new buffers (the same shapes) then take the
        old ones' room in order. Made while the old state was alive, they went elsewhere and the allocator's
        reuse of the freed room left memory in use that no array owned (scripts/memory_stages.py). The collection:
        flax's Variables sit in reference cycles, so dropped state keeps its device buffers until one runs."""
        self.lora = self.opt_state = None
        gc.collect()
        self.lora = self.placement.place(lora)
        self.opt_state = self.placement.place_like(
            self.optimizer.init(self.lora) if opt_state is None else opt_state, self.lora)

    @property
    def loaded(self) -> bool:
        return self.frozen is not None

    def variant(self, execution: ExecutionConfig, lora=None) -> "Run":
        """A run with other execution settings over the same loaded weights (for A/B comparisons in one
        process): per-layer buffers are made (as copies) when the new layer loop unrolls and this one does not,
        the LoRA state starts from `lora` (host or device arrays; default: a copy of this run's) with a fresh
        optimizer state."""
        other = dataclasses.replace(self, execution=execution)
        other.graphdef, other.rng = self.graphdef, self.rng
        frozen = self.frozen
        if other.unrolled and not self.unrolled:
            frozen = unstack_layers(frozen)
        elif self.unrolled and not other.unrolled:
            frozen = restack_layers(frozen)
        lora = jax.tree.map(jnp.copy, self.lora) if lora is None else lora
        other.frozen = other.placement.place(frozen)
        other.set_state(lora)
        return other

    # ------------------------------------------------------------------ compiling and stepping
    def local_rows(self, num_rows: int) -> np.ndarray:
        """Which rows of a step's global batch of `num_rows` rows this process feeds (`Placement.local_rows`;
        one process: all of them, in order). Host batches given to `compile` / `step` are those rows."""
        return self.placement.local_rows(num_rows, self.accumulation)

    def device_batch(self, host_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's [A*b, T] host rows -> the step's global [A, B, T] device batch (rows split over the
        (data, fsdp) mesh axes)."""
        return self.placement.batch(stack_micro_batches(host_batch, self.accumulation))

    def _batch_spec(self, host_batch):
        """Global shapes/dtypes of the device batch made from `host_batch` (what a compiled step serves)."""
        return _abstract(self.placement.abstract_batch(stack_micro_batches(host_batch, self.accumulation)))

    def _step_fn(self, graphdef, lora, opt_state, frozen, batch):
        """The jitted step with the placement's shardings as its in/out shardings (XLA adds the collectives)."""
        p = self.placement
        lora_sh = p.shardings(lora)
        opt_sh = p.like(opt_state, lora, lora_sh)
        batch_sh = {k: p.batch_sharding(len(v.shape)) for k, v in batch.items()}
        return make_train_step(graphdef, self.optimizer, self.schedule, execution=self.execution,
                               dropout=self.lora_config.dropout > 0,
                               in_shardings=(lora_sh, opt_sh, p.shardings(frozen), batch_sh, p.replicated),
                               out_shardings=(lora_sh, opt_sh, p.replicated))

    def compile(self, host_batch: dict[str, np.ndarray]):
        """Compiles the training step for batches shaped like `host_batch` ([A*B, T] arrays). Before `load`
        it compiles from shapes alone. Returns the compiled step (its `memory_analysis()` gives the static
        memory) and records `compile_seconds`."""
        if self.execution.remat == "auto":
            self.choose_remat(host_batch)
            return self._compiled
        began = time.perf_counter()
        stacked = stack_micro_batches(host_batch, self.accumulation)
        batch = self.placement.abstract_batch(stacked)
        key = jax.random.fold_in(self.rng, 0)  # a shape only: the devices may be a compile target, not this host's
        rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=self.placement.replicated)
        if self.loaded:
            args = (self.lora, self.opt_state, self.frozen)
            graphdef = self.graphdef
        else:  # shapes only; the step's in_shardings say where each argument will live
            graphdef, lora, frozen = self.abstract_state()
            args = (lora, jax.eval_shape(self.optimizer.init, lora), frozen)
            self.graphdef = graphdef
        with self.placement.tracing():
            lowered = self._step_fn(graphdef, *args, batch).lower(*args, batch, rng)
        self._compiled = lowered.compile()
        self._compiled_spec = _abstract(batch)
        self.compile_seconds = time.perf_counter() - began
        return self._compiled

    def compiled_for(self, host_batch: dict[str, np.ndarray]) -> bool:
        """Whether the compiled step serves batches shaped like `host_batch`."""
        return self._compiled is not None and self._batch_spec(host_batch) == self._compiled_spec

    def _budget(self) -> tuple[int, str]:
        """(bytes, where from) a step may plan to use on each device: `max_memory_gb`, else the free memory of
        this process's first device less a margin (`default_memory_budget`); several processes take the
        smallest of theirs, so that every process chooses the same step."""
        if self.execution.max_memory_gb is not None:
            return int(self.execution.max_memory_gb * GIB), "max_memory_gb"
        local = [d for d in self.placement.devices if d.process_index == jax.process_index()]
        budget, source = default_memory_budget(local[0])
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

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
                self.execution = base.replace(max_memory_gb=budget / GIB)
                try:
                    self.choose_remat(host_batch, log=log)
                except ExecutionConfigError:
                    estimates[mesh.describe()] = min(self.remat_estimates.values())
                    log(f"mesh auto: {mesh.describe()} no remat policy fits -> does not fit")
                    continue
                finally:
                    self.execution = dataclasses.replace(self.execution, max_memory_gb=base.max_memory_gb)
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
        raise ExecutionConfigError(
            "max_memory_gb", f"no mesh fits in {budget / GIB:.3f} GiB per device ({source}): the smallest estimate "
            f"is {smallest} at {estimates[smallest] / GIB:.3f} GiB; raise max_memory_gb, use more devices, or lower "
            "per_device_train_batch_size / max_seq_length")

    def choose_remat(self, host_batch: dict[str, np.ndarray], *, log=logger.info) -> str:
        """Resolves `remat: auto` (a no-op for any other policy): compiles the step from shapes for each policy
        of `jaxft.remat.AUTO_ORDER` (fastest expected first), estimates its device peak (`peak_estimate`) and
        keeps the first within `max_memory_gb` (default `default_memory_budget`); between "none" and the next
        policy it tries full remat on the first k layers (`_partial_remat`) while k layers recompute less than
        offload+attn on this batch (`jaxft.remat.partial_full_limit`), else after offload+attn if that does not
        fit. Every compile logs one line (what, its estimate, and why it was compiled); slower candidates than the
        choice are not compiled. The chosen step stays compiled; `remat_compiles` lists what was compiled.
        Raises ExecutionConfigError on key max_memory_gb (one line, with the smallest estimate) when nothing fits.
        Must run before `load`: the policy decides the layer loop, hence the weight layout."""
        base = self.execution
        if base.remat != "auto":
            return base.remat
        if self.loaded:
            raise RuntimeError("Run.choose_remat after Run.load(): choose the policy before the weights are placed")
        budget, source = self._budget()
        log(f"remat auto: device budget {budget / GIB:.2f} GiB ({source}); candidates in order of expected speed: "
            f"{', '.join(AUTO_ORDER)}")
        self._auto_seconds, self.remat_estimates, self.remat_probes, self.remat_compiles = 0.0, {}, {}, []

        def fits(policy: str, layers: int | None = None, *, probe: bool = False) -> bool:
            """Compiles `policy` (on the first `layers` layers) at the model's depth and says whether it fits; a
            fitting probe is measured, not chosen, so it neither logs "chosen" nor ends the compile count."""
            name = candidate_name(policy, layers)
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
        deferred = None  # full remat on the first k layers, passed over for offload+attn: (k, per-layer saving)
        for policy in AUTO_ORDER:
            if policy == "full" and deferred is not None and self._partial_at(fits, *deferred, budget, log)[0]:
                return self.execution.remat  # offload+attn did not fit; k layers beat full remat on all of them
            if fits(policy):
                rest = AUTO_ORDER[AUTO_ORDER.index(policy) + 1:]
                if rest:
                    log(f"remat auto: chose {policy} (not compiled: {', '.join(rest)}, expected slower)")
                return policy
            if policy == "none":
                chosen, deferred = self._partial_remat(fits, shallow, budget, limit, log)
                if chosen:
                    return self.execution.remat
        self.execution, self._compiled, self._compiled_spec = base, None, None
        smallest = min(self.remat_estimates, key=self.remat_estimates.get)
        raise ExecutionConfigError(
            "max_memory_gb", f"no remat policy fits in {budget / GIB:.3f} GiB ({source}): the smallest estimate is "
            f"{smallest} at {self.remat_estimates[smallest] / GIB:.3f} GiB; raise max_memory_gb, or lower "
            "per_device_train_batch_size / max_seq_length")

    def _host_fit(self, ex: ExecutionConfig, host_batch: dict[str, np.ndarray], log) -> ExecutionConfig | None:
        """`ex` if what its policy offloads fits the host budget (`host_memory_gb`, else the machine's memory less
        a margin: `jaxft.remat.default_host_budget`); for "offload" that does not fit, `ex` in nested blocks sized to
        the budget (`remat_block: auto`); None (logged) for another policy that does not fit. The bytes are those of
        the micro-batch this process holds (several local devices' shards together)."""
        if not remat_policies.parse(ex.remat).offloads:
            return ex
        rows, seq = host_batch["input_ids"].shape[0] // self.accumulation, host_batch["input_ids"].shape[-1]
        itemsize = jnp.dtype(self.dtype).itemsize
        need = remat_policies.offloaded_bytes(ex.layer_policy(self.model_config, rows, seq, itemsize),
                                              self.model_config, rows, seq, itemsize, ex.mlp_chunk_size)
        host = ex.host_budget_bytes()
        if need <= host:
            return ex
        if ex.remat == "offload" and ex.remat_block is None:
            nested = ex.replace(remat_block="auto")
            k = nested.block_for(self.model_config, rows, seq, itemsize)
            log(f"remat auto: offload's layer inputs need {need / GIB:.2f} GiB of host memory, over the host budget "
                f"{host / GIB:.2f} GiB: offload in nested blocks of {k} layers (remat_block auto)")
            return nested
        log(f"remat auto: {ex.remat:<12} offloads {need / GIB:.2f} GiB, over the host budget {host / GIB:.2f} GiB "
            "-> does not fit (host)")
        return None

    @property
    def remat_choice(self) -> tuple[str, int] | None:
        """What `remat: auto` chose, named as in `remat_estimates` ("full on 2 layers" for full remat on the first
        2 layers), and its estimated peak bytes; None when auto has not run."""
        if not self.remat_estimates:
            return None
        name = candidate_name(self.execution.remat, self.execution.remat_layers)
        return name, self.remat_estimates[name]

    def _compile_candidate(self, run: "Run", base: ExecutionConfig, host_batch: dict[str, np.ndarray], policy: str,
                           layers: int | None, name: str, verdict, log) -> int:
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

    def _shallow(self, depth: int) -> "Run":
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
        budget can still find no room for its temp: Gemma-2-9B packed 16k, no remat, ran out of memory at a
        73.54 GiB temp beside 34 GiB of regions holding 18 GiB of weights (docs/benchmarks.md section 17). The
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
        """`fit_allocator` after auto chose a policy of the layer scan: the scan policies after it in AUTO_ORDER
        (slower and leaner; all keep the stacked weights as placed) in turn, skipping one whose host copies miss
        the host budget, until one's temp fits; returns the last temp."""
        ex = self.execution
        for policy in AUTO_ORDER[AUTO_ORDER.index(ex.remat) + 1:]:
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

    def step(self, host_batch: dict[str, np.ndarray], step_index: int) -> dict[str, jax.Array]:
        """One optimizer update on `host_batch` (compiled on first use); returns the step's metrics, still on
        the device (fetching them is the caller's sync point)."""
        if not self.loaded:
            raise RuntimeError("Run.step before Run.load(): the weights are not on the device yet")
        batch = self.device_batch(host_batch)
        if self._compiled is None or _abstract(batch) != self._compiled_spec:
            self.compile(host_batch)
        self.lora, self.opt_state, metrics = self._compiled(self.lora, self.opt_state, self.frozen, batch,
                                                            jax.random.fold_in(self.rng, step_index))
        return metrics

    def evaluate(self, host_batches) -> tuple[float, float]:
        """(summed token loss, target count) over [B, T] host batches; the eval loss is their ratio."""
        if self._eval_fn is None:
            self._eval_fn = make_eval_step(self.graphdef, execution=self.execution)
        loss_sum, count = 0.0, 0.0
        for batch in host_batches:
            s, c = self._eval_fn(self.lora, self.frozen, self.placement.batch(batch))
            loss_sum, count = loss_sum + float(s), count + float(c)
        return loss_sum, count

    def memory_analysis(self) -> dict[str, int]:
        """XLA's static memory analysis of the compiled step (bytes), {} before `compile`."""
        stats = self._compiled.memory_analysis() if self._compiled is not None else None
        keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                "generated_code_size_in_bytes", "peak_memory_in_bytes")
        return {k: int(getattr(stats, k)) for k in keys if stats is not None and hasattr(stats, k)}

    # ------------------------------------------------------------------ the trained model
    def model(self, *, restack: bool = False):
        """The model with its current LoRA state (per-layer weight buffers stacked back when `restack`, as
        exports need; that frees the per-layer buffers, so the run cannot step afterwards)."""
        frozen = restack_layers(self.frozen, delete_source=True) if restack else self.frozen
        if restack:
            self.frozen = frozen
        return nnx.merge(self.graphdef, self.lora, frozen)

    def _host_model(self, *, weights: bool):
        """The model for an export when the arrays span several processes: every process must call this (the
        gathers are collectives); the state comes back as host arrays, the frozen weights gathered one layer at
        a time (weights=False: the split weights as shapes only, for an adapter export, which reads the LoRA
        state, scales and ranks alone)."""
        frozen = restack_layers(self.frozen, delete_source=True) if self.unrolled else self.frozen
        self.frozen = frozen
        lora = jax.tree.map(_to_host, self.lora)
        if not weights:  # the replicated leaves (LoRA scales and ranks, norms) are read locally; the rest: shapes
            frozen = jax.tree.map(lambda x: np.asarray(x) if x.is_fully_replicated else
                                  jax.ShapeDtypeStruct(x.shape, x.dtype), frozen)
        else:
            frozen = jax.tree.map(_to_host, frozen)
        return nnx.merge(self.graphdef, lora, frozen)

    def export_adapter(self, path: str | Path, *, tokenizer=None) -> Path:
        """Writes the PEFT adapter to `path`. Several processes: all call it, process 0 writes."""
        from jaxft.distributed import is_main_process
        from jaxft.lora import save_adapter

        model = self.model(restack=self.unrolled) if jax.process_count() == 1 else self._host_model(weights=False)
        if not is_main_process():
            return Path(path)
        save_adapter(model, path, base_model_name_or_path=str(self.model_path.absolute()))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
        return Path(path)

    def export_merged(self, path: str | Path, *, tokenizer=None) -> Path:
        """Writes the merged HF model to `path`. Several processes: all call it (each weight is gathered onto
        every host, layer by layer), process 0 writes."""
        from jaxft.distributed import is_main_process
        from jaxft.io import save_pretrained

        model = self.model(restack=self.unrolled) if jax.process_count() == 1 else self._host_model(weights=True)
        if not is_main_process():
            return Path(path)
        save_pretrained(model, path)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
        return Path(path)


def _to_host(x):
    """A (possibly multi-process) array as one host numpy array. Sharded arrays are gathered by a collective
    that every process runs, a stacked [L, ...] weight one layer at a time (so no device holds more than one
    whole layer of it)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    if x.ndim >= 3:
        return np.stack([np.asarray(multihost_utils.process_allgather(x[i], tiled=True)) for i in range(x.shape[0])])
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
