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
`ExecutionConfig`; the model itself holds only parameters and math. The automatic choices (`mesh: auto`,
`remat: auto`, the allocator re-fit) and the memory estimate they use live in `jaxft.auto` (`AutoChoices`, a base
class of `Run`).

Compiling before loading matters on a GPU: XLA's autotuner allocates scratch while it compiles, and with the
weights resident that transient can exceed the training peak, which the allocator's peak statistic then hides.
"""

from __future__ import annotations

import contextlib
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
from jaxft import streamed
from jaxft.auto import AutoChoices
from jaxft.config import SPARSE_MLPS, ModelConfig
from jaxft.execution import ExecutionConfig, ExecutionConfigError
from jaxft.lora import LoraConfig, apply_lora, save_adapter, target_names
from jaxft.lora.trained import resize_embeddings
from jaxft.models.build import abstract_model, init_model, model_class
from jaxft.models.stack import streamed_weight
from jaxft.offload_scan import is_slot
from jaxft.quant.config import Fp8Config
from jaxft.sharding import MeshConfig, Placement
from jaxft.train.optim import OptimConfig
from jaxft.train.step import (make_eval_step, make_train_step, restack_layers, split_model, stack_micro_batches,
                              unstack_layers)
from jaxft.distributed import is_main_process
from jaxft.io import from_pretrained, read_generation_config, save_gguf, save_pretrained
from jaxft.quant.fp8 import abstract_fp8
from jaxft.quant.weights import abstract_quantize
from kernels_pallas.grouped_matmul import implementation_for


def _abstract(tree):
    """Shapes and (canonical: int64 host arrays become int32 on the device) dtypes of a tree of arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jax.dtypes.canonicalize_dtype(x.dtype)), tree)


@dataclasses.dataclass
class Run(AutoChoices):
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
    # The training objective: None for token cross-entropy (SFT), else its part (`jaxft.train.dpo.DpoConfig`).
    objective: Any = None

    def __post_init__(self):
        self.model_path = Path(self.model_path).expanduser()
        self.model_config = ModelConfig.from_hf(bridge.read_config(self.model_path),
                                                source=str(self.model_path / "config.json"))
        if self.vocab_size is not None and self.vocab_size != self.model_config.vocab_size:
            self.model_config = dataclasses.replace(self.model_config, vocab_size=self.vocab_size)
        self.optimizer, self.schedule = self.optim.build(self.total_steps)
        devices = jax.devices() if self.devices is None else list(self.devices)
        if self.streams_weights and len(devices) > 1:
            raise ExecutionConfigError("frozen_weights", f"'host' streams one device's weights; this run has "
                                       f"{len(devices)} devices: set frozen_weights: device")
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
    def from_config(cls, config, total_steps: int, *, devices=None, lora_config=None, vocab_size=None) -> "Run":
        """The run a `jaxft.train.TrainConfig` describes (its validated model, LoRA, execution and optimiser
        parts); `lora_config` / `vocab_size` replace its LoRA part and vocabulary (new tokens)."""
        return cls(model_path=config.model.path, lora_config=lora_config or config.lora, execution=config.execution,
                   optim=config.optim, total_steps=total_steps, dtype=config.model.dtype, seed=config.seed,
                   accumulation=config.gradient_accumulation_steps, devices=devices, quant_config=config.model.quant,
                   mesh=config.mesh_config, vocab_size=vocab_size, objective=config.objective)

    # ------------------------------------------------------------------ building the state
    @property
    def unrolled(self) -> bool:
        """Whether the layers run unrolled (`ExecutionConfig.resolved_layer_loop`), except that `layer_loop: auto`
        scans an MoE model whose experts run the Mosaic GPU grouped matmul when nothing needs the unrolled loop:
        every call site of a Mosaic GPU kernel is compiled on its own, so 24 unrolled GPT-OSS-20B layers compile
        for over 4 minutes, where the scan compiles each kernel once."""
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
        if not set(SPARSE_MLPS) & set(self.model_config.layer_mlps):
            return False
        device = self.placement.devices[0]
        return implementation_for(self.execution.grouped_matmul_implementation, self.dtype, device) == "pallas_mosaic"

    def _abstract_split(self):
        def build():
            model = model_class(self.model_config)(self.model_config, dtype=jnp.dtype(self.dtype),
                                                   rngs=nnx.Rngs(0))
            if isinstance(self.quant_config, Fp8Config):
                abstract_fp8(model, self.quant_config)
            else:
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
        if self.streams_weights:
            return graphdef, lora, streamed.pack(frozen, self._host_sharding)
        return graphdef, lora, unstack_layers(frozen) if self.unrolled else frozen

    def load(self) -> "Run":
        """Reads the weights, applies LoRA (seeded), splits by variable type and places the state."""
        if self.execution.remat == "auto":
            raise RuntimeError("Run.load() with remat 'auto': call run.choose_remat(batch) or run.compile(batch) "
                               "first (the chosen policy decides the weight layout)")
        # One device: whole arrays. A mesh: each weight is read shard by shard into its place (jaxft.io); a 4-bit
        # base is quantised on one device and then placed (its codes and scales split over fsdp by `_adopt`).
        mesh = self.placement if len(self.placement.devices) > 1 and self.quant_config is None else None
        with self._reading_place():
            model = from_pretrained(self.model_path, self.dtype, quant_config=self.quant_config, mesh=mesh)
            if self.vocab_size is not None:
                resize_embeddings(model, self.vocab_size, seed=self.seed)
            model = apply_lora(model, self.lora_config, seed=self.seed)
        graphdef, lora, frozen = split_model(model)
        del model  # its LoRA buffers are donated to the step; its stacked weights go as they are split
        return self._adopt(graphdef, lora, frozen)

    def _host_device(self):
        """The host's CPU device where `load` reads a streamed model's weights before packing (`frozen_weights:
        host`, a bf16/f32 base), so the whole model never lands on the accelerator; None otherwise (or when this
        process has no CPU backend), and for a 4-bit base, quantised on the accelerator one layer at a time.
        (`init_random` still makes them on the accelerator: XLA's CPU threefry would hold uint32 buffers of about
        the model's size on the host, see `random_state_program`.)"""
        if not self.streams_weights or self.quant_config is not None:
            return None
        try:
            return jax.devices("cpu")[0]
        except RuntimeError:  # JAX_PLATFORMS without cpu
            return None

    def _reading_place(self):
        """Where `load` reads the checkpoint into (`_host_device`, else the default device); `_adopt` then packs
        the streamed weights into pinned host memory and places the rest."""
        host = self._host_device()
        return contextlib.nullcontext() if host is None else jax.default_device(host)

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
            return split_model(apply_lora(model, self.lora_config, seed=self.seed))[1:]
        return graphdef, jax.jit(make, out_shardings=(self.placement.shardings(lora), self.frozen_shardings(frozen)))

    @property
    def streams_weights(self) -> bool:
        """Whether the layer stacks' frozen weights live in pinned host memory, packed (`jaxft.streamed`)."""
        return self.execution.frozen_weights == "host"

    @property
    def _host_sharding(self) -> jax.sharding.Sharding:
        return self.placement.replicated.with_memory_kind("pinned_host")

    def frozen_shardings(self, frozen):
        """Where each frozen array lives: the placement's sharding; with `frozen_weights: host`, a packed buffer
        (`jaxft.streamed.PackedSlot`) in pinned host memory, and before packing (`init_random`'s program) the
        entries that will be packed there too."""
        flat = []
        for p, v in nnx.to_flat_state(frozen):
            value = v.get_value()
            if is_slot(value):
                flat.append((p, v.replace(dataclasses.replace(value, rows=self._host_sharding))))
            elif self.streams_weights and streamed_weight(p, v):
                flat.append((p, v.replace(self.placement.sharding_of(v).with_memory_kind("pinned_host"))))
            else:
                flat.append((p, v.replace(self.placement.sharding_of(v))))
        return nnx.from_flat_state(flat)

    def streamed_buffers(self) -> dict[tuple[str, str], int]:
        """{packed buffer key (stack, dtype): bytes} of the frozen weights `frozen_weights: host` keeps in pinned host
        memory (`jaxft.streamed.buffer_bytes`), from the abstract state: nothing is read."""
        return streamed.buffer_bytes(self._abstract_split()[2])

    def streamed_weight_bytes(self) -> int:
        """Bytes of the frozen weights `frozen_weights: host` keeps in pinned host memory (`streamed_buffers`)."""
        return sum(self.streamed_buffers().values())

    def _place_frozen(self, frozen, *, delete_source: bool = True):
        """`frozen` in its places (`frozen_shardings`), packed first with `frozen_weights: host` (the packing reads
        each array to the host and, with `delete_source`, frees it)."""
        if self.streams_weights and not streamed.is_packed(frozen):
            frozen = streamed.pack(frozen, self._host_sharding, delete_source=delete_source)
        return jax.device_put(frozen, self.frozen_shardings(frozen))

    def _adopt(self, graphdef, lora, frozen) -> "Run":
        """Takes a model's split state (`split_model`): per-layer buffers where the layers run unrolled, each
        array placed on the mesh, a fresh optimizer state (the end of `load` and `init_random`)."""
        if self.unrolled:  # a stacked array at a time is sliced, then freed
            frozen = unstack_layers(frozen, delete_source=True)
        self.graphdef = graphdef
        self.lora, self.frozen = self.placement.place(lora), self._place_frozen(frozen)
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
        other.frozen = other._place_frozen(frozen, delete_source=False)  # this run keeps its weights
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
                               dropout=self.lora_config.dropout > 0, objective=self.objective,
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
            self._eval_fn = make_eval_step(self.graphdef, execution=self.execution, objective=self.objective)
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
        model = self.model(restack=self.unrolled) if jax.process_count() == 1 else self._host_model(weights=False)
        if not is_main_process():
            return Path(path)
        save_adapter(model, path, base_model_name_or_path=str(self.model_path.absolute()))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))
        return Path(path)

    def export_merged(self, path: str | Path, *, tokenizer=None) -> Path:
        """Writes the merged HF model to `path`, with the base's generation_config.json (its stop ids and
        decoding defaults). Several processes: all call it (each weight is gathered onto every host, layer by
        layer), process 0 writes."""
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


def _to_host(x):
    """A (possibly multi-process) array as one host numpy array. Sharded arrays are gathered by a collective
    that every process runs, a stacked [L, ...] weight one layer at a time (so no device holds more than one
    whole layer of it)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)

    if x.ndim >= 3:
        return np.stack([np.asarray(multihost_utils.process_allgather(x[i], tiled=True)) for i in range(x.shape[0])])
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
