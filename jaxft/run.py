"""`Run`: the one recipe behind `jaxft-train`, the Python API, the benchmarks and the ablation script.

    run = Run.from_config(train_config, total_steps)      # or Run(model_dir, lora=..., execution=..., optim=...)
    run.compile(host_batch)        # optional, before load(): compiled from shapes, no weight on the device yet
    run.choose_remat(host_batch)   # remat "auto": compiles candidates from shapes, keeps the fastest that fits
    run.describe(rows, seq)        # what the plan does beyond its keys' names, as log lines
    run.load()                     # HF weights -> LoRA -> split by type -> per-layer buffers? -> placed
    metrics = run.step(host_batch, step_index)                 # one optimizer update (the compiled step)
    loss_sum, count = run.evaluate(host_batches)
    run.export_adapter(dir); run.export_merged(dir)

What it holds: the model's `graphdef`, the trainable `lora` state and the optimizer state (donated to each
step: updated in place), the `frozen` state (base weights, LoRA scales; read only), the run's RNG key. With
`finetuning_type="full"` the trainable state is every weight, as fp32 masters (`jaxft.train.full`), and
`export_merged` writes the trained model.
Execution settings (attention kernel, remat, layer loop, CE chunk, compiler options) come from one
`ExecutionConfig`; the model itself holds only parameters and math. The automatic choices (`mesh: auto`,
`remat: auto`, the allocator re-fit) are `jaxft.memory.choice`'s functions over this run's compile (`_compiler`);
the run takes the execution they return and keeps their `trials`.

Compiling before loading matters on a GPU: XLA's autotuner allocates scratch while it compiles, and with the
weights resident that transient can exceed the training peak, which the allocator's peak statistic then hides.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

import bridge
from jaxft.config import SPARSE_MLPS, ModelConfig
from jaxft.distributed import is_main_process
from jaxft.io import from_pretrained, read_generation_config, save_gguf, save_pretrained
from jaxft.lora import LoraConfig, apply_lora, save_adapter, target_names
from jaxft.lora.trained import resize_embeddings
from jaxft.memory import choice, streamed
from jaxft.memory.budget import contiguous_room, host_available_memory
from jaxft.memory.execution import ExecutionConfig, ExecutionConfigError
from jaxft.memory.policy import attention_copies_pay
from jaxft.models.build import abstract_model, init_model, model_class
from jaxft.quant.config import Fp8Config
from jaxft.quant import fp8 as fp8_base
from jaxft.quant.weights import abstract_quantize
from jaxft.sharding import MeshConfig, Placement
from jaxft.train import full as full_ft
from jaxft.train.optim import OptimConfig
from jaxft.train.step import (make_eval_step, make_train_step, restack_layers, split_model, stack_micro_batches,
                              unstack_layers)
from kernels_pallas.grouped_matmul import implementation_for


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
    quant_config: Any = None  # jaxft.quant.QuantConfig (4 bits, QLoRA) or Fp8Config: frozen linears; None: as stored
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    # New tokens: the embeddings (and an untied head) grow to this many rows on load, with transformers' mean
    # initialisation (`jaxft.lora.trained.resize_embeddings`); None: as stored.
    vocab_size: int | None = None
    # "lora": adapters (`lora_config`); "full": every weight trained, `lora_config` unused (`jaxft.train.full`).
    finetuning_type: str = "lora"
    # The training objective: None for token cross-entropy (SFT), else its part (`jaxft.train.dpo.DpoConfig`).
    objective: Any = None

    def __post_init__(self):
        self.model_path = Path(self.model_path).expanduser()
        self.model_config = ModelConfig.from_hf(bridge.read_config(self.model_path),
                                                source=str(self.model_path / "config.json"))
        if self.vocab_size is not None and self.vocab_size != self.model_config.vocab_size:
            self.model_config = dataclasses.replace(self.model_config, vocab_size=self.vocab_size)
        if self.finetuning_type not in full_ft.FINETUNING_TYPES:
            raise ValueError(f"finetuning_type {self.finetuning_type!r}: one of {full_ft.FINETUNING_TYPES}")
        decay_mask = None
        if self.full:
            if self.quant_config is not None:
                raise ValueError("full fine-tuning trains every weight: a quantised base (quant_config) cannot be "
                                 "trained; load it in bf16 or fp32")
            self.execution = full_ft.full_execution(self.execution)
            decay_mask = full_ft.decay_mask(abstract_model(self.model_config, dtype=jnp.float32))
            if self.objective is not None:
                raise ValueError("full fine-tuning has no adapters, and the DPO reference is the model with its "
                                 "adapters off: train DPO with finetuning_type lora")
        self.optimizer, self.schedule = self.optim.build(self.total_steps, decay_mask=decay_mask)
        self.compute_dtypes = None  # full: the dtypes the fp32 masters are cast to (`_abstract_split`)
        self.placement = placement_for(self.execution, self.mesh, self.devices)
        wanted = fp8_base.program_options(self.quant_config, self.placement.devices[0])
        if wanted:  # the user's compiler_options win
            self.execution = self.execution.replace(compiler_options={**wanted, **self.execution.compiler_options})
        self.rng = jax.random.key(self.seed)
        self.graphdef = self.lora = self.frozen = self.opt_state = None
        self._compiled = self._compiled_spec = self._eval_fn = None
        self.compile_seconds = 0.0
        self.trials = choice.Trials()  # what remat "auto" compiled (estimates, probes, compiles, in order)

    @classmethod
    def from_config(cls, config, total_steps: int, *, devices=None, lora_config=None, vocab_size=None) -> "Run":
        """The run a `jaxft.train.TrainConfig` describes (its validated model, LoRA, execution and optimiser
        parts); `lora_config` / `vocab_size` replace its LoRA part and vocabulary (new tokens)."""
        return cls(model_path=config.model.model_name_or_path, lora_config=lora_config or config.lora_config,
                   execution=config.execution_config, optim=config.optim_config, total_steps=total_steps,
                   dtype=config.model.dtype, seed=config.optim.seed,
                   accumulation=config.optim.gradient_accumulation_steps, devices=devices,
                   quant_config=config.quant_config, mesh=config.mesh_config, vocab_size=vocab_size,
                   finetuning_type=config.lora.finetuning_type,
                   objective=config.objective_config)

    @property
    def full(self) -> bool:
        """Whether every weight is trained (`finetuning_type="full"`) rather than LoRA adapters."""
        return self.finetuning_type == "full"

    def _trained(self, model):
        """`model` made trainable as this run trains it: LoRA applied, or (full) as it is."""
        return model if self.full else apply_lora(model, self.lora_config, seed=self.seed)

    def _split(self, model, *, delete_source: bool = False):
        """`split_model` by this run's trainable type; a full fine-tune's trainable state in fp32 (masters), the
        dtypes it computes with kept in `compute_dtypes`."""
        if not self.full:
            return split_model(model)
        graphdef, params, frozen = split_model(model, full_ft.TRAINED_TYPE)
        self.compute_dtypes = full_ft.compute_dtypes(params)
        return graphdef, full_ft.to_master(params, delete_source=delete_source), frozen

    @property
    def cast(self):
        """What the step applies to the trainable state before the forward (`jaxft.train.full.caster`): None for
        LoRA and for fp32 masters that compute in fp32."""
        if not self.full:
            return None
        if self.compute_dtypes is None:
            self._abstract_split()
        return full_ft.caster(self.compute_dtypes)

    def _computed(self, lora):
        """The trainable state as the model computes with it (a full fine-tune's masters cast)."""
        cast = self.cast
        return lora if cast is None else cast(lora)

    # ------------------------------------------------------------------ building the state
    @property
    def unrolled(self) -> bool:
        """Whether the layers run unrolled (`ExecutionConfig.unrolls`); a full fine-tune scans them."""
        return not self.full and self.execution.unrolls(self.mosaic_experts)

    @property
    def layer_loop(self) -> str:
        """The layer loop this run uses, "unroll" or "scan" (`unrolled`), as the configs spell it."""
        return "unroll" if self.unrolled else "scan"

    @property
    def mosaic_experts(self) -> bool:
        """Whether the model has expert layers whose grouped matmul resolves to the Mosaic GPU kernels here."""
        if not set(SPARSE_MLPS) & set(self.model_config.layer_mlps):
            return False
        device = self.placement.devices[0]
        return implementation_for(self.execution.grouped_matmul_implementation, self.dtype, device) == "pallas_mosaic"

    def _abstract_split(self):
        def build():
            model = model_class(self.model_config)(self.model_config, dtype=jnp.dtype(self.dtype),
                                                   rngs=nnx.Rngs(0))
            if isinstance(self.quant_config, Fp8Config):
                fp8_base.abstract_fp8(model, self.quant_config, self.model_path)
            else:
                abstract_quantize(model, self.model_path, self.quant_config)
            return self._trained(model)
        return self._split(nnx.eval_shape(build))

    def check_targets(self) -> list[str]:
        """The HF module names the LoRA config adapts (raises `LoraConfigError` when a target matches nothing);
        reads no weights; none for a full fine-tune."""
        if self.full:
            return []
        return _check_targets(self.model_config, self.lora_config)

    def abstract_state(self):
        """(graphdef, lora, frozen) as shapes: what `load` would build, with nothing allocated."""
        graphdef, lora, frozen = self._abstract_split()
        if self.streams_weights:
            return graphdef, lora, streamed.pack(frozen, streamed.host_sharding(self.placement))
        return graphdef, lora, unstack_layers(frozen) if self.unrolled else frozen

    def load(self) -> "Run":
        """Reads the weights, applies LoRA (seeded), splits by variable type and places the state."""
        if self.execution.remat == "auto":
            raise RuntimeError("Run.load() with remat 'auto': call run.choose_remat(batch) or run.compile(batch) "
                               "first (the chosen policy decides the weight layout)")
        # One device: whole arrays. A mesh: each weight is read shard by shard into its place (jaxft.io); a 4-bit
        # base is quantised on one device and then placed (its codes and scales split over fsdp by `_adopt`).
        mesh = self.placement if len(self.placement.devices) > 1 and self.quant_config is None else None
        with streamed.reading_place(self.streams_weights and self.quant_config is None):
            model = from_pretrained(self.model_path, self.dtype, quant_config=self.quant_config, mesh=mesh)
            if self.vocab_size is not None:
                resize_embeddings(model, self.vocab_size, seed=self.seed)
            model = self._trained(model)
        graphdef, lora, frozen = self._split(model, delete_source=True)
        del model  # its LoRA buffers are donated to the step; its stacked weights go as they are split
        return self._adopt(graphdef, lora, frozen)

    def init_random(self) -> "Run":
        """Like `load`, with random weights instead of the checkpoint's (`jaxft.models.build.init_model`:
        normal(0, 0.02) linears and embeddings, unit norms; seeded by `seed`): a run of a model shape that has no
        weights on disk, e.g. memory and speed at real sizes (experiments/probes/max_context.py,
        experiments/probes/bench_scaling.py). Not for a 4-bit base (its codes come from the checkpoint's weights).

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
            raise ValueError("Run.init_random() with a quantised base (quant_config): random 4-bit or FP8 codes "
                             "are not supported; use load()")
        graphdef, make = self.random_state_program()
        return self._adopt(graphdef, *make())

    def random_state_program(self):
        """(graphdef, program): the jitted program `init_random` runs, returning the (lora, frozen) states with every
        array made in its place on the mesh (`out_shardings`). Compiled for a GPU, it keeps no temporaries: XLA
        fuses each array's threefry draws, normal transform and cast into the kernel that writes it (Llama-3.1-8B on
        one device: 15.1 GiB of outputs, 0 of temporaries). XLA's
        CPU backend runs threefry as a loop over [shard]-sized uint32 buffers instead: a 70B init over 8 CPU
        devices would keep 75 GiB of them per device; the CPU makes tiny models only. Lower and compile it to see
        its memory per device."""
        graphdef, lora, frozen = self._abstract_split()

        def make():
            model = init_model(self.model_config, dtype=jnp.dtype(self.dtype), seed=self.seed)
            return self._split(self._trained(model))[1:]
        return graphdef, jax.jit(make, out_shardings=(self.placement.shardings(lora), self.frozen_shardings(frozen)))

    @property
    def streams_weights(self) -> bool:
        """Whether the layer stacks' frozen weights live in pinned host memory, packed (`jaxft.memory.streamed`)."""
        return self.execution.frozen_weights == "host"

    def frozen_shardings(self, frozen):
        """Where each frozen array lives (`jaxft.memory.streamed.frozen_shardings`)."""
        return streamed.frozen_shardings(self.placement, frozen, self.streams_weights)

    def streamed_buffers(self) -> dict[tuple[str, str], int]:
        """{packed buffer key (stack, dtype): bytes} of the frozen weights `frozen_weights: host` keeps in pinned host
        memory (`jaxft.memory.streamed.buffer_bytes`), from the abstract state: nothing is read."""
        return streamed.buffer_bytes(self._abstract_split()[2])

    def streamed_weight_bytes(self) -> int:
        """Bytes of the frozen weights `frozen_weights: host` keeps in pinned host memory (`streamed_buffers`)."""
        return sum(self.streamed_buffers().values())

    def _adopt(self, graphdef, lora, frozen) -> "Run":
        """Takes a model's split state (`split_model`): per-layer buffers where the layers run unrolled, each
        array placed on the mesh, a fresh optimizer state (the end of `load` and `init_random`)."""
        if self.unrolled:  # a stacked array at a time is sliced, then freed
            frozen = unstack_layers(frozen, delete_source=True)
        self.graphdef = graphdef
        self.lora = self.placement.place(lora)
        self.frozen = streamed.place(self.placement, frozen, self.streams_weights)
        self.opt_state = self.placement.place_like(self.optimizer.init(self.lora), self.lora)
        return self

    def set_state(self, lora, opt_state=None) -> None:
        """Replaces the trainable state (a restored checkpoint, or a fresh LoRA init for another task); without
        `opt_state`, a fresh optimizer state for `lora`.

        The old state is released BEFORE the new one is placed: the new buffers (the same shapes) then take the
        old ones' room in order. Made while the old state was alive, they went elsewhere and the allocator's reuse of
        the freed room left memory in use that no array owned (experiments/probes/memory_stages.py). The collection:
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
        if streamed.is_packed(frozen) and not other.streams_weights:
            frozen = streamed.unpack(frozen)
        if other.unrolled and not self.unrolled:
            frozen = unstack_layers(frozen)
        elif self.unrolled and not other.unrolled:
            frozen = restack_layers(frozen)
        lora = jax.tree.map(jnp.copy, self.lora) if lora is None else lora
        # this run keeps its weights
        other.frozen = streamed.place(other.placement, frozen, other.streams_weights, delete_source=False)
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
                               dropout=self.lora_config.dropout > 0 and not self.full, cast=self.cast,
                               objective=self.objective,
                               in_shardings=(lora_sh, opt_sh, self.frozen_shardings(frozen), batch_sh, p.replicated),
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

    def evaluate(self, host_batches, *, metrics: dict[str, float] | None = None) -> tuple[float, float]:
        """(summed token loss, target count) over [B, T] host batches (with an objective: its loss sum and count,
        e.g. DPO's pairs); the eval loss is their ratio. `metrics` receives the objective's own metrics as means
        over that count (DPO: rewards/*, logps/*; SFT has none)."""
        if self._eval_fn is None:
            self._eval_fn = make_eval_step(self.graphdef, execution=self.execution, cast=self.cast,
                                           objective=self.objective)
        loss_sum, count, sums = 0.0, 0.0, {}
        for batch in host_batches:
            s, c, *extra = self._eval_fn(self.lora, self.frozen, self.placement.batch(batch))
            loss_sum, count = loss_sum + float(s), count + float(c)
            for key, value in (extra[0] if extra else {}).items():
                sums[key] = sums.get(key, 0.0) + float(value)
        if metrics is not None:
            metrics.update({key: value / max(count, 1.0) for key, value in sums.items()})
        return loss_sum, count

    def memory_analysis(self) -> dict[str, int]:
        """XLA's static memory analysis of the compiled step (bytes), {} before `compile`."""
        stats = self._compiled.memory_analysis() if self._compiled is not None else None
        keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                "generated_code_size_in_bytes", "peak_memory_in_bytes")
        return {k: int(getattr(stats, k)) for k in keys if stats is not None and hasattr(stats, k)}

    # ------------------------------------------------------------------ the automatic choices
    def _host_memory(self) -> tuple[int, str]:
        """(bytes, what) this host can still give: the CPU device budget's source."""
        return host_available_memory()

    def _copies_pay(self, host_batch: dict[str, np.ndarray]) -> tuple[bool, float, float]:
        """`jaxft.memory.policy.attention_copies_pay` on one micro-batch of `host_batch` at the activation dtype."""
        segments = host_batch.get("segment_ids", np.ones_like(host_batch["input_ids"]))
        return attention_copies_pay(self.model_config, segments[:segments.shape[0] // self.accumulation],
                                    jnp.dtype(self.dtype).itemsize)

    def _target(self) -> choice.Target:
        """What the automatic choices plan for (`jaxft.memory.choice.Target`)."""
        return choice.Target(self.model_config, tuple(self.placement.devices), self.accumulation, self.dtype,
                             self.mosaic_experts, self.streamed_weight_bytes, self._host_memory, self._copies_pay)

    def _compiler(self, host_batch: dict[str, np.ndarray]) -> choice.CompileFn:
        """The choices' compile callback: this run's step for `host_batch` under an execution, on a mesh (the run's
        placement moves to it) and at a depth (a copy of this run whose model is its first layers, with no state,
        compiled from shapes: this run's step stays as it was)."""
        def compile_candidate(execution: ExecutionConfig, depth: int | None = None, mesh=None) -> choice.Compiled:
            if mesh is not None and mesh is not self.placement.config:
                self.placement = Placement(mesh, self.devices)
                self.graphdef = self._compiled = self._compiled_spec = None
            run = self
            if depth is not None:
                run = copy.copy(self)
                run.model_config = self.model_config.first_layers(depth)
                run.graphdef = run.lora = run.frozen = run.opt_state = None
                run._compiled = run._compiled_spec = run._eval_fn = None
            run.execution = execution
            run.compile(host_batch)
            return choice.Compiled(run.memory_analysis(), run.compile_seconds)
        return compile_candidate

    def _decide(self, choose, host_batch: dict[str, np.ndarray], log, *args) -> choice.Decision:
        """`choose(target, *args, execution, host_batch, compile, ...)` of `jaxft.memory.choice` over this run; on
        a refusal the run is left with its execution and no compiled step."""
        base = self.execution
        try:
            return choose(self._target(), *args, base, host_batch, self._compiler(host_batch), trials=self.trials,
                          log=log)
        except ExecutionConfigError:
            self.execution, self._compiled, self._compiled_spec = base, None, None
            raise

    def choose_mesh(self, host_batch: dict[str, np.ndarray], *, log=choice.logger.info) -> MeshConfig:
        """Resolves `mesh: auto` (a no-op for a given mesh; `jaxft.memory.choice.choose_mesh`, with `remat: auto`
        each mesh's own remat choice); the chosen step stays compiled. Must run before `load`."""
        if not self.mesh.auto:
            return self.mesh
        if self.loaded:
            raise RuntimeError("Run.choose_mesh after Run.load(): choose the mesh before the weights are placed")
        auto = self.execution.remat == "auto"
        try:
            decision = self._decide(choice.choose_mesh, host_batch, log, self.mesh)
        except ExecutionConfigError:
            self.placement = Placement(self.mesh.candidates(len(self.placement.devices))[0], self.devices)
            raise
        self.mesh, self.execution = decision.mesh, decision.execution
        if auto:  # (else the last compile's, the chosen step's)
            self.compile_seconds = self.trials.seconds
        return self.mesh

    def choose_remat(self, host_batch: dict[str, np.ndarray], *, log=choice.logger.info) -> str:
        """Resolves `remat: auto` (a no-op for any other policy; `jaxft.memory.choice.choose_remat`) and returns the
        policy; the chosen step stays compiled, `trials` lists what was compiled. Must run before `load`: the
        policy decides the layer loop, hence the weight layout."""
        base = self.execution
        if base.remat != "auto":
            return base.remat
        if self.loaded:
            raise RuntimeError("Run.choose_remat after Run.load(): choose the policy before the weights are placed")
        self.execution = self._decide(choice.choose_remat, host_batch, log).execution
        self.compile_seconds = self.trials.seconds
        return self.execution.remat

    def fit_allocator(self, host_batch: dict[str, np.ndarray], *, stats: dict[str, int] | None = None,
                      log=choice.logger.info) -> None:
        """After `load`: re-chooses a leaner step of `remat: auto`'s where the step's temporaries do not fit where
        the device's allocator can still place one buffer (`jaxft.memory.choice.fit_allocator`; `stats`: the
        device's `memory_stats()`). A no-op where the device does not report its pool (CPU) or the step fits."""
        if not self.loaded:
            raise RuntimeError("Run.fit_allocator before Run.load(): the allocator's pool is known once the weights "
                               "are placed")
        if stats is None:
            local = [d for d in self.placement.devices if d.process_index == jax.process_index()]
            stats = local[0].memory_stats() or {}
        if contiguous_room(stats) is None:
            return
        if not self.compiled_for(host_batch):
            self.compile(host_batch)
        self.execution = choice.fit_allocator(self._target(), self.execution, host_batch, self.memory_analysis(),
                                              stats, self._compiler(host_batch), trials=self.trials,
                                              log=log).execution

    @property
    def remat_choice(self) -> tuple[str, int] | None:
        """What `remat: auto` chose, named as in `trials.estimates` ("full on 2 layers" for full remat on the first
        2 layers), and its estimated peak bytes; None when auto has not run."""
        return self.trials.choice(self.execution)

    def describe(self, rows: int, seq: int, *, samples: bool = False) -> list[tuple[int, str]]:
        """(logging level, line)s saying what this run's step does beyond its keys' names, for micro-batches of
        [`rows`, `seq`] over all batch-parallel devices, with sample generations (`samples`) or not
        (`ExecutionConfig.describe`; nothing is read)."""
        return self.execution.describe(self.model_config, rows=rows, seq=seq, itemsize=jnp.dtype(self.dtype).itemsize,
                                       devices=len(self.placement.devices), mosaic_experts=self.mosaic_experts,
                                       streamed=self.streamed_buffers() if self.streams_weights else None,
                                       samples=samples)

    # ------------------------------------------------------------------ the trained model
    def model(self, *, restack: bool = False, on_device: bool = False):
        """The model with its current LoRA state (per-layer weight buffers stacked back when `restack`, as
        exports need; that frees the per-layer buffers, so the run cannot step afterwards). Weights packed for
        streaming (`frozen_weights: host`) come back as host arrays for exports, or as a device copy with
        `on_device` (generation computes on them)."""
        frozen = restack_layers(self.frozen, delete_source=True) if restack else self.frozen
        if restack:
            self.frozen = frozen
        if streamed.is_packed(frozen):
            frozen = streamed.unpack(frozen)
            if on_device:
                frozen = self.placement.place(frozen)
        return nnx.merge(self.graphdef, self._computed(self.lora), frozen)

    def _host_model(self, *, weights: bool):
        """The model for an export when the arrays span several processes: every process must call this (the
        gathers are collectives); the state comes back as host arrays, the frozen weights gathered one layer at
        a time (weights=False: the split weights as shapes only, for an adapter export, which reads the LoRA
        state, scales and ranks alone)."""
        frozen = restack_layers(self.frozen, delete_source=True) if self.unrolled else self.frozen
        self.frozen = frozen
        lora = jax.tree.map(_to_host, self._computed(self.lora))
        if not weights:  # the replicated leaves (LoRA scales and ranks, norms) are read locally; the rest: shapes
            frozen = jax.tree.map(lambda x: np.asarray(x) if x.is_fully_replicated else
                                  jax.ShapeDtypeStruct(x.shape, x.dtype), frozen)
        else:
            frozen = jax.tree.map(_to_host, frozen)
        return nnx.merge(self.graphdef, lora, frozen)

    def export_adapter(self, path: str | Path, *, tokenizer=None) -> Path:
        """Writes the PEFT adapter to `path`. Several processes: all call it, process 0 writes."""
        if self.full:
            raise ValueError("a full fine-tune has no adapter: export the trained model with export_merged")
        model = self.model(restack=self.unrolled) if jax.process_count() == 1 else self._host_model(weights=False)
        if not is_main_process():
            return Path(path)
        save_adapter(model, path, base_model_name_or_path=str(self.model_path.absolute()))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
        return Path(path)

    def export_merged(self, path: str | Path, *, tokenizer=None) -> Path:
        """Writes the merged HF model (a full fine-tune: the trained model, in its compute dtype) to `path`, with
        the base's generation_config.json (its stop ids and decoding defaults). Several processes: all call it (each
        weight is gathered onto every host, layer by layer), process 0 writes."""
        model = self.model(restack=self.unrolled) if jax.process_count() == 1 else self._host_model(weights=True)
        if not is_main_process():
            return Path(path)
        save_pretrained(model, path, generation_config=read_generation_config(self.model_path))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
        return Path(path)

    def export_gguf(self, path: str | Path, dtype: str, *, tokenizer=None) -> Path:
        """Writes the merged model as one GGUF file at `path` (`jaxft.save_gguf`). Several processes: all call it,
        process 0 writes."""
        model = self.model(restack=self.unrolled) if jax.process_count() == 1 else self._host_model(weights=True)
        if not is_main_process():
            return Path(path)
        return save_gguf(model, path, dtype, tokenizer=tokenizer)


def _check_targets(model_config: ModelConfig, lora_config: LoraConfig) -> list[str]:
    return target_names(abstract_model(model_config, dtype=jnp.float32), lora_config)


def check_config(config, devices=None) -> Placement:
    """What `Run.from_config(config, ...)` refuses, checked from shapes before any data is read and without building
    a run: a mesh or settings that do not fit the devices (`placement_for`), LoRA targets that match no module
    (`LoraConfigError`). Returns the placement, whose `batch_parallel` sizes the data the run is then built for."""
    placement = placement_for(config.execution_config, config.mesh_config, devices)
    path = Path(config.model.model_name_or_path).expanduser()
    if config.lora.finetuning_type != "full":  # (a full fine-tune has no targets)
        _check_targets(ModelConfig.from_hf(bridge.read_config(path), source=str(path / "config.json")),
                       config.lora_config)
    return placement


def placement_for(execution: ExecutionConfig, mesh: MeshConfig | None = None, devices=None) -> Placement:
    """Where a run of `execution` on `mesh` over `devices` (None: all) puts its state; raises MeshConfigError where
    the mesh does not fit the devices and ExecutionConfigError where the settings do not (weights streamed from
    host memory on several devices). What `Run` checks first, so a caller that only needs the placement (the
    batch-parallel size that sizes the data) builds no run."""
    devices = jax.devices() if devices is None else list(devices)
    if execution.frozen_weights == "host" and len(devices) > 1:
        raise ExecutionConfigError("frozen_weights", f"'host' streams one device's weights; this run has "
                                   f"{len(devices)} devices: set frozen_weights: device")
    return Placement(mesh, devices)


def _to_host(x):
    """A (possibly multi-process) array as one host numpy array. Sharded arrays are gathered by a collective
    that every process runs, a stacked [L, ...] weight one layer at a time (so no device holds more than one
    whole layer of it)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)

    if x.ndim >= 3:
        return np.stack([np.asarray(multihost_utils.process_allgather(x[i], tiled=True)) for i in range(x.shape[0])])
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
