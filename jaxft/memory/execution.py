"""`ExecutionConfig`: how a step runs, kept apart from what the model computes.

The model holds parameters and math; everything that changes speed or memory but not the numbers
(up to float rounding) lives here and is handed to the forward pass and the step builder:

- `attention_implementation`: which attention kernel runs (see `kernels_pallas.attention`): "auto" picks per
  batch on the device (cuDNN for single-document rows, the Pallas flash kernel for packed rows, the XLA
  reference on CPU), or one of "reference" ("xla" is its older spelling), "pallas", "cudnn".
- `grouped_matmul_implementation`: which grouped matmul the MoE layers run (`kernels_pallas.grouped_matmul`):
  every grouped matmul of a step (expert projections, expert LoRA products, the 4-bit experts' dequantise-then-gmm
  forward and backward) takes it. "auto" runs the Mosaic GPU kernels on Hopper for bf16/f16 and `lax.ragged_dot`
  elsewhere; "xla" (ragged_dot), "reference" (masked dense) or "pallas_mosaic" (the Mosaic kernels; in Mosaic
  GPU's interpreter off the GPU) by name; also the A/B switch of the MoE benchmarks. (XLA cannot partition the
  Mosaic custom call: on a mesh it runs per device, `moe_dispatch`.)
- `moe_dispatch`: where an MoE layer sorts and multiplies its tokens under a mesh of several devices:
  "per_device" (the block in `jax.shard_map` over the batch axes, each device its own rows:
  `jaxft.models.moe.per_device`) or "global" (the block as one program over the whole batch: XLA gathers the
  routing, and every device multiplies every token); "auto" is per_device.
- `remat`: what the backward pass keeps, offloads to pinned host memory or recomputes (`jaxft.memory.policy`: "none",
  "full", "offload", "offload+attn", "save=..;offload=..", "auto"); a mapping {save: [...], offload: [...]} is
  accepted and stored as its canonical string. `max_memory_gb` is "auto"'s device budget (None: the device's free
  memory less a margin, `jaxft.memory.budget.default_memory_budget`); `host_memory_gb` what "auto" and nested blocks may
  put in host memory. `remat_layers` = N applies the policy to the first N layers only and runs the rest without
  remat (None: every layer): "auto"'s step between "none" and a policy on all layers when "none" does not fit
  (Gemma-3-12B 1 x 4096 within 40 GB, H200: full on 25 of 48 layers, 7,914 tok/s, 1.66x Unsloth; unrolled loop
  only; `jaxft.run.Run.choose_remat`); not a user key.
  `remat_block` = k (remat "full" or "offload", layer scan): nested checkpointing, blocks of k layers of which only
  the block input is kept (on the device / in pinned host memory) for one more forward of compute
  (`jaxft.memory.policy`); "auto" takes the smallest k whose block inputs fit `host_memory_gb` (None: the machine's
  memory less a margin) for "offload", ceil(sqrt(L)) for "full"; None or 1: every layer its own checkpoint.
- `offload_transfer`: how remat "offload" moves each layer input to pinned host memory: "policy" (jax.checkpoint's
  offload policy), "explicit" (`jaxft.memory.offload`: the two copies written in a custom VJP, each copy back started
  when the layer above starts its backward; in a layer scan, for remat "offload" only, `jaxft.memory.scan_offload`: one
  custom VJP around the scan that copies each layer input back one layer early) or "auto" (explicit in the unrolled
  loop, whose policy copies XLA folds away, the policy in the scan, whose copies XLA keeps). Other offloading policies
  unrolled go through the explicit transfer with their policy's own copies inside it.
- `layer_loop`: "scan" runs one layer body over stacked weights; "unroll" one program region per layer over
  per-layer weight buffers (no weight-slice copies, longer compile); "auto" unrolls only without remat (the
  offloading policies are tuned for the scan).
- `mlp_chunk_size`: the MLP runs over sequence chunks of this many tokens, each under a save-nothing
  checkpoint, so one layer never holds [T, intermediate] activations (None: one chunk); where it tiles, no
  remat policy keeps `mlp_gate_up` (it is recomputed per chunk).
- `ce_chunk_size` / `ce_implementation`: the linear cross-entropy's token chunk and kernel. None picks by
  length (`resolved_ce_chunk`).
- `frozen_weights`: where the frozen weights of the layer stack live: "device", "host" (pinned host memory,
  each layer's copied in one layer ahead of its use, in the forward and again in the backward:
  `jaxft.memory.scan_offload` `HostRows`). What it buys: the device holds two layers' weights instead of all of them (8B
  bf16: about 0.9 of 15 GiB). What it costs: every layer's weights cross the host link twice a step (8B: about 30 GB,
  about 0.57 s at 53 GB/s), hidden only where a step's compute is longer. Layer scan, one device, a remat
  policy that offloads at most the layer input (none, full, offload, offload+attn, save=..): what it keeps
  is kept as without streaming; or one that keeps nothing on the device (offload=..): what it keeps
  goes to the host through the scan. MoE expert stacks and a 4-bit base's codes and scales stream too; the embeddings,
  head and small rows (norms, biases, LoRA scales) stay on the device. "auto" (the default): on the device,
  unless `remat: auto` finds no policy that fits with them there on one device; it then tries its candidates
  again with the weights streamed (`jaxft.memory.choice`).
- `compiler_options`: XLA options for the step's program only (never process-wide flags), over the ones the
  settings want (`program_options`: the scan's pipelined host offload).

Frozen and validated once; every error names the field, a field of `jaxft-train`'s `execution` mapping (whose
presets are the `memory` key's, `MEMORY_PRESETS`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

import jax

from jaxft.errors import KeyedConfigError
from jaxft.memory import policy as remat_policies
from jaxft.residuals import LAYER_INPUT
from kernels_pallas.grouped_matmul import IMPLEMENTATIONS as GROUPED_MATMUL_IMPLEMENTATIONS
from kernels_pallas.linear_cross_entropy import tiles_for

ATTENTION_IMPLEMENTATIONS = ("auto", "reference", "xla", "pallas", "cudnn")
REMAT_POLICIES = remat_policies.FIXED  # plus selective 'save=..;offload=..' strings
LAYER_LOOPS = ("auto", "scan", "unroll")
OFFLOAD_TRANSFERS = ("auto", "policy", "explicit")
FROZEN_WEIGHTS = ("auto", "device", "host")
CE_IMPLEMENTATIONS = ("xla", "reference")
MOE_DISPATCHES = ("auto", "per_device", "global")
# The `memory` key's presets: each is the ExecutionConfig fields of one measured benchmark recipe
# (examples/bench/<recipe>.yaml, numbers in docs/benchmarks.md), named for what it buys; explicit `execution`
# fields win over a preset's, field by field. Llama-3.1-8B shape, LoRA r 16 on every linear, one GPU.
MEMORY_PRESETS: dict[str, dict[str, Any]] = {
    # The fastest policy whose compiled step fits `max_memory_gb` (`jaxft.memory.choice`): at 8B 1 x 4096 on an H200 it
    # chose no remat, within 0.6% of fast; at 1 x 65536, offload+attn (5,281 tok/s at 47.25 GiB).
    "auto": {"remat": "auto"},
    # No remat, layers unrolled (fast.yaml): 8B 1 x 4096, H200: 14,799 tok/s at 27.76 GiB (1.44x Unsloth).
    "fast": {"remat": "none", "layer_loop": "auto"},
    # Layer inputs to pinned host, attention output and statistics kept on the device (offload_attn.yaml): the
    # backward recomputes projections and MLP, never the attention. Gemma-2-9B packed 1 x 16384, H200: 8,683 tok/s
    # at 30.04 GiB (3.15x Unsloth).
    "balanced": {"remat": "offload+attn", "layer_loop": "scan"},
    # Layer inputs to pinned host, the rest recomputed, small loss chunks (lean.yaml): Unsloth's memory at its
    # speed or better. 8B 1 x 4096, H100: 10,439 tok/s at 16.89 GiB (Unsloth 10,159 at 16.68).
    "lean": {"remat": "offload", "layer_loop": "scan", "ce_chunk_size": 256},
    # Layer inputs and attention residuals to pinned host, frozen weights streamed from host one layer ahead
    # (lean_attn_host.yaml): the smallest device memory measured. 8B 1 x 16384, H100: 8,366 tok/s at 6.87 GiB
    # (Unsloth 8,260 at 19.73).
    "max_context": {"remat": "offload=layer_input,attn_out,attn_lse", "layer_loop": "scan",
                    "frozen_weights": "host"},
}
MEMORY_HELP = {
    "auto": "the fastest mode that fits max_memory_gb (the default)",
    "fast": "no remat, layers unrolled: fastest, most memory (8B 1x4096 H200: 14,799 tok/s, 27.76 GiB)",
    "balanced": "layer inputs to host, attention kept on device (Gemma-2-9B packed 16k H200: 8,683 tok/s, 30.04 GiB)",
    "lean": "layer inputs to host, the rest recomputed: Unsloth's memory (8B 1x4096 H100: 10,439 tok/s, 16.89 GiB)",
    "max_context": "layer inputs and attention to host, frozen weights streamed from host: least device memory "
                   "(8B 1x16384 H100: 8,366 tok/s, 6.87 GiB)",
}

# The smallest cross-entropy chunk under remat. Below 256 tokens the [chunk, H] x [H, V] matmuls run slower for
# no memory: 2% slower at 128 on the lean GPT-OSS-20B 1 x 4096 step, at the same peak.
CE_CHUNK_FLOOR = 256


class ExecutionConfigError(KeyedConfigError):
    """A bad execution setting; `field` is the offending ExecutionConfig field (= the flat config key)."""


def _choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ExecutionConfigError(field, f"value {value!r} is not one of {', '.join(map(repr, choices))}")


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
    attention_implementation: str = "auto"
    remat: str = "none"
    remat_layers: int | None = None
    remat_block: int | str | None = None
    layer_loop: str = "auto"
    ce_chunk_size: int | None = None
    mlp_chunk_size: int | None = None
    max_memory_gb: float | None = None
    host_memory_gb: float | None = None
    ce_implementation: str = "xla"
    compiler_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    offload_transfer: str = "auto"
    grouped_matmul_implementation: str = "auto"
    moe_dispatch: str = "auto"
    frozen_weights: str = "auto"

    def __post_init__(self):
        _choice("attention_implementation", self.attention_implementation, ATTENTION_IMPLEMENTATIONS)
        _choice("grouped_matmul_implementation", self.grouped_matmul_implementation, GROUPED_MATMUL_IMPLEMENTATIONS)
        _choice("moe_dispatch", self.moe_dispatch, MOE_DISPATCHES)
        try:
            object.__setattr__(self, "remat", remat_policies.canonical(self.remat))
        except remat_policies.RematError as e:
            raise ExecutionConfigError("remat", str(e).removeprefix("remat ")) from None
        _choice("layer_loop", self.layer_loop, LAYER_LOOPS)
        n = self.remat_layers
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ExecutionConfigError("remat_layers", f"value {n!r} must be an integer >= 0 (or null for every "
                                                           "layer)")
            if self.remat in ("none", "auto"):
                raise ExecutionConfigError("remat_layers", f"is set ({n}) but remat is {self.remat!r}: it applies a "
                                           "remat policy to the first N layers, so set remat to that policy (e.g. "
                                           "full), or drop remat_layers")
            if self.layer_loop == "scan":
                raise ExecutionConfigError("remat_layers", "needs the unrolled layer loop (one region per layer); set "
                                           "layer_loop: unroll (or auto), or drop remat_layers")
        self._check_block()
        self._check_frozen_weights()
        _choice("ce_implementation", self.ce_implementation, CE_IMPLEMENTATIONS)
        _choice("offload_transfer", self.offload_transfer, OFFLOAD_TRANSFERS)
        parsed = None if self.remat == "auto" else remat_policies.parse(self.remat)
        if self.offload_transfer == "explicit" and self.layer_loop == "scan" and parsed is not None and \
                parsed.offloads and not parsed.explicit_capable:
            # In a scan the explicit transfer is `jaxft.memory.scan_offload` (the layer input alone, a full recompute);
            # a policy's other host copies would be residuals stacked by the scan's AD in a host buffer, which XLA's
            # layout assignment rejects (JAX 0.11.2: "Expected instruction to have shape equal to").
            raise ExecutionConfigError("offload_transfer", f"'explicit' in the layer scan takes remat: offload only "
                                       f"(got {self.remat!r}; XLA cannot place the scan's stacked host copies of "
                                       "other residuals); set layer_loop: unroll (or auto), or offload_transfer: auto")
        chunk = self.ce_chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ExecutionConfigError("ce_chunk_size", f"value {chunk!r} must be an integer >= 1 (or null for the "
                                                        "kernel's default)")
        chunk = self.mlp_chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ExecutionConfigError("mlp_chunk_size", f"value {chunk!r} must be an integer >= 1 (or null for "
                                                         "one chunk)")
        for key in ("max_memory_gb", "host_memory_gb"):
            gb = getattr(self, key)
            if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb > 0):
                raise ExecutionConfigError(key, f"value {gb!r} must be a number of GiB > 0 (or null)")
        if not isinstance(self.compiler_options, Mapping) or not all(isinstance(k, str)
                                                                     for k in self.compiler_options):
            raise ExecutionConfigError("compiler_options", f"value {self.compiler_options!r} must be a mapping of "
                                                           "XLA option name to value")
        # Frozen all the way down: the config is hashed into compiled-step caches.
        object.__setattr__(self, "compiler_options", dict(self.compiler_options))

    def _check_block(self) -> None:
        k = self.remat_block
        if k is None or k == 1 and not isinstance(k, bool):
            return
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ExecutionConfigError("remat_block", f"value {k!r} must be an integer >= 1, 'auto' or null (every "
                                                      "layer its own checkpoint)")
        if self.remat not in ("full", "offload"):
            raise ExecutionConfigError("remat_block", f"is set ({k!r}) but remat is {self.remat!r}: nested blocks "
                                       "keep the layer input alone, so set remat: full or offload, or drop remat_block")
        if self.offload_transfer == "explicit":
            raise ExecutionConfigError("remat_block", "takes the policy's host copies (offload_transfer: auto or "
                                       "policy), not 'explicit'; drop one of the two")
        if self.resolved_layer_loop != "scan":
            raise ExecutionConfigError("remat_block", "needs the layer scan (blocks are an outer scan over inner "
                                       "scans): set layer_loop: scan (or auto)")

    def _check_frozen_weights(self) -> None:
        _choice("frozen_weights", self.frozen_weights, FROZEN_WEIGHTS)
        if self.frozen_weights != "host":
            return
        if self.remat != "auto" and not remat_policies.parse(self.remat).streams:
            # The streamed scan (`jaxft.memory.scan_offload`) moves the layer input, or every kept residual, to the host
            # itself; a policy that keeps some names on the device and offloads others would leave jax.checkpoint's
            # host copies for the scan to stack (RematPolicy.streams). remat auto's candidates all stream.
            raise ExecutionConfigError("frozen_weights", f"'host' runs under a remat policy that offloads at most the "
                                       f"layer input or keeps nothing on the device (got {self.remat!r}): e.g. remat: "
                                       "offload, offload+attn, full, none, "
                                       "'offload=layer_input,attn_out,attn_lse' or auto, or set frozen_weights: device")
        if self.layer_loop == "unroll":
            raise ExecutionConfigError("frozen_weights", "'host' streams each layer's rows of the stacked weights "
                                       "through the layer scan: set layer_loop: scan (or auto)")
        if self.remat_block not in (None, 1):
            raise ExecutionConfigError("frozen_weights", "'host' and remat_block (nested blocks) do not combine yet; "
                                       "drop remat_block or set frozen_weights: device")

    def block_for(self, cfg, batch: int, seq: int, itemsize: int) -> int:
        """Layers per nested block for a [batch, seq] micro-batch (`remat_block`, "auto" resolved; 1: none)."""
        k = self.remat_block
        if k is None:
            return 1
        if k != "auto":
            return min(k, cfg.num_layers)
        host = self.host_budget_bytes() if self.remat == "offload" else None
        stream = remat_policies.residual_bytes(cfg, batch, seq, itemsize)[LAYER_INPUT]
        return remat_policies.block_layers(cfg.num_layers, stream, host)

    def host_budget_bytes(self) -> int:
        """The host bytes offloaded residuals may take: `host_memory_gb`, else the machine's memory less a margin
        (`jaxft.memory.policy.default_host_budget`)."""
        if self.host_memory_gb is not None:
            return int(self.host_memory_gb * 2**30)
        return remat_policies.default_host_budget()

    @property
    def attention(self) -> str:
        """The attention implementation as `kernels_pallas.attention` names it ("xla" is the reference)."""
        return "reference" if self.attention_implementation == "xla" else self.attention_implementation

    def layer_policy(self, cfg, batch: int, seq: int, itemsize: int,
                     remat: str | None = None) -> remat_policies.RematPolicy:
        """The per-layer policy of `remat` (default the `remat` key) for a [batch, seq] micro-batch of model `cfg`:
        with a tiled MLP no policy keeps the names inside it (`jaxft.memory.policy.tiled_mlp_names`); the policy carries
        `offload_transfer`."""
        remat = self.remat if remat is None else remat
        policy = remat_policies.parse(remat)
        dropped = remat_policies.tiled_mlp_names(seq, self.mlp_chunk_size)
        if dropped and policy.kind == "names":
            policy = policy.without(dropped)
        return dataclasses.replace(policy, transfer=self.offload_transfer,
                                   block=self.block_for(cfg, batch, seq, itemsize))

    def layer_remats(self, num_layers: int) -> tuple[str, ...] | None:
        """The remat policy string of each of `num_layers` layers where layers differ (None: every layer takes
        `remat`): `remat_layers` = N, the policy on layers 0..N-1 and none after (N >= L: every layer)."""
        if self.remat_layers is None:
            return None
        n = min(self.remat_layers, num_layers)
        return (self.remat,) * n + ("none",) * (num_layers - n)

    def layer_policies(self, cfg, batch: int, seq: int,
                       itemsize: int) -> tuple[remat_policies.RematPolicy, ...] | None:
        """`layer_remats` as policies for a [batch, seq] micro-batch (`layer_policy`; None: every layer takes
        `layer_policy`)."""
        remats = self.layer_remats(cfg.num_layers)
        if remats is None:
            return None
        made = {p: self.layer_policy(cfg, batch, seq, itemsize, p) for p in set(remats)}
        return tuple(made[p] for p in remats)

    def resolved_ce_chunk(self, num_tokens: int, vocab_size: int, hidden_size: int, itemsize: int,
                          device_kind: str | None = None) -> int | None:
        """`ce_chunk_size`, or when None the rule by length: without remat, the kernel's default (a fixed
        byte budget per [chunk, vocab] fp32 block, `kernels_pallas.linear_cross_entropy.config`); with any remat
        policy the block is also capped at 4 x one layer input of the step (num_tokens x hidden x itemsize x 4),
        so the loss never needs more transient memory than a few residual-stream tensors, floored at
        `CE_CHUNK_FLOOR` tokens (8B, 1 x 4096: 256 tokens; 1 x 65536: the kernel's 512). `device_kind` defaults to
        the first device's."""
        if self.ce_chunk_size is not None or self.remat == "none":
            return self.ce_chunk_size

        default = tiles_for(device_kind or jax.devices()[0].device_kind, num_tokens, vocab_size)
        cap = max(CE_CHUNK_FLOOR, (4 * num_tokens * hidden_size * itemsize) // (vocab_size * 4) // 128 * 128)
        return min(default, cap, num_tokens)

    @property
    def resolved_layer_loop(self) -> str:
        """"auto" unrolls without remat, with remat on some layers (`remat_layers`) and with
        `offload_transfer: explicit` (its host copies go through `jaxft.memory.offload`'s explicit transfer, which needs
        unrolled layers): the host offload and recompute policies on every layer are tuned for the scan."""
        if self.layer_loop != "auto":
            return self.layer_loop
        if self.frozen_weights == "host":
            return "scan"
        return "unroll" if self.remat == "none" or self.needs_unrolled_layers else "scan"

    def unrolls(self, mosaic_experts: bool) -> bool:
        """Whether the layers run unrolled (`resolved_layer_loop`), except that `layer_loop: auto` scans an MoE
        model whose experts run the Mosaic GPU grouped matmul (`mosaic_experts`) when nothing needs the unrolled
        loop: every call site of a Mosaic GPU kernel is compiled on its own, so 24 unrolled GPT-OSS-20B layers
        compile for over 4 minutes, where the scan compiles each kernel once."""
        if self.resolved_layer_loop != "unroll":
            return False
        return not (self.layer_loop == "auto" and not self.needs_unrolled_layers and mosaic_experts)

    def describe(self, cfg, *, rows: int, seq: int, itemsize: int, devices: int = 1, mosaic_experts: bool = False,
                 streamed: Mapping[Any, int] | None = None, samples: bool = False) -> list[tuple[int, str]]:
        """What a step of model `cfg` under these settings does beyond its key's name, as (logging level, line):
        how the Mosaic GPU expert kernels (`mosaic_experts`) compile and split over `devices`, the explicit transfer
        of an offloading policy over unrolled layers, nested blocks for micro-batches of [`rows`, `seq`] (all
        batch-parallel devices' rows, as the step's trace sees them) and what each side holds, the bytes of
        `streamed` weights (`jaxft.memory.streamed.buffer_bytes`), what crosses the host link per step and what sample
        generations (`samples`) copy."""
        lines, chosen = [], self.remat != "auto"
        unrolled = self.unrolls(mosaic_experts)
        if mosaic_experts and self.resolved_layer_loop == "unroll":
            lines.append((logging.WARNING, "layer_loop=unroll with the Mosaic GPU grouped matmul: each layer's "
                          "expert kernels compile on their own (24 GPT-OSS-20B layers: over 4 minutes); layer_loop: "
                          "auto scans them") if unrolled else
                         (logging.INFO, "layer_loop auto: the layers are scanned, so the Mosaic GPU expert kernels "
                          "compile once"))
        if mosaic_experts and devices > 1:
            # XLA's SPMD partitioner cannot split a custom call: it gathers the kernels' operands, so every device
            # runs every token's experts.
            lines.append((logging.WARNING, f"grouped_matmul_implementation resolves to the Mosaic GPU kernels on a "
                          f"mesh of {devices} devices with moe_dispatch: global: XLA does not partition their custom "
                          "call (each device runs all tokens' experts); set moe_dispatch: per_device (or auto)")
                         if self.moe_dispatch == "global" else
                         (logging.INFO, f"the Mosaic GPU expert kernels run per device on the mesh of {devices} "
                          f"devices (moe_dispatch {self.moe_dispatch}: each device its own rows, "
                          "jaxft.models.moe.per_device); not yet run on several GPUs"))
        if chosen and unrolled and remat_policies.parse(self.remat).offloads:
            lines.append((logging.INFO, "layer_loop=unroll with an offloading remat policy: the host copies take the "
                          "explicit transfer (jaxft/memory/offload.py), each layer's input copied back one layer ahead "
                          "(most of the copy time hidden under compute; it keeps one more layer input on the device); "
                          "layer_loop: scan is the default"))
        if chosen and self.remat_block is not None:
            policy = self.layer_policy(cfg, rows, seq, itemsize)
            stream = remat_policies.residual_bytes(cfg, rows, seq, itemsize)[LAYER_INPUT]
            blocks = -(-cfg.num_layers // policy.block)
            lines.append((logging.INFO, f"remat {self.remat} in nested blocks of {policy.block} layers (remat_block "
                          f"{self.remat_block}): {blocks} block inputs ({blocks * stream / 2**30:.2f} GiB) in "
                          f"{'pinned host memory' if policy.offloads else 'device memory'}, one block's "
                          f"{policy.block} layer inputs ({policy.block * stream / 2**30:.2f} GiB) on the device while "
                          "it is differentiated; each step runs one more forward of every layer"))
        if self.frozen_weights == "host" and streamed:
            total = sum(streamed.values())
            lines.append((logging.INFO, f"frozen_weights host: {_size(total)} of layer weights in pinned host memory "
                          f"({len(streamed)} packed buffers), each layer's {_size(total / cfg.num_layers)} copied to "
                          "the device one layer ahead in the forward and again in the backward "
                          f"({_size(2 * total)} over the host link per step)"))
            if samples:
                lines.append((logging.WARNING, f"eval_generate_prompts with frozen_weights host: each sample "
                              f"generation copies the {_size(total)} of streamed weights to the device for its "
                              "duration (generation does not stream them)"))
        return lines

    @property
    def needs_unrolled_layers(self) -> bool:
        """Whether these settings only run on unrolled layers (remat on some layers; the explicit transfer's host
        copies), as opposed to preferring them (no remat: faster unrolled)."""
        return self.remat_layers is not None or self.offload_transfer == "explicit"

    @property
    def program_options(self) -> dict[str, Any]:
        """The XLA options the step's program compiles with: `compiler_options` over what these settings want.
        A policy that offloads in the layer scan gets XLA's pipelined host offloading: each layer's copy to pinned
        host then runs beside the next layer's forward (the scan's dynamic-update-slice into the host stack is
        started in one iteration and waited for in the next), where it otherwise ends before the layer's first
        matmul (GPT-OSS-20B lean step 283.6 -> 279.0 ms). The backward's copies back are not pipelined by it. Not
        with nested blocks (`remat_block`), which are there for memory: its loop peeling holds a second copy of a
        block's stacked layer inputs (8B at 1 x 65536 in blocks of 2: temp 8.43 GiB with it, 6.92 without). Nor
        where the layer scan is `jaxft.memory.scan_offload.offloaded_scan` (streamed frozen weights, the explicit
        transfer): the loop it pipelines is then ours, and pipelined, XLA makes most fetches from host memory inside
        the loops (the weight rows, the layer inputs and kept residuals coming back) kernels reading host memory over
        PCIe instead of copies."""
        wanted: dict[str, Any] = {}
        ours = self.frozen_weights == "host" or self.offload_transfer == "explicit"
        offloading_scan = self.remat != "auto" and self.resolved_layer_loop == "scan" \
            and remat_policies.parse(self.remat).offloads and self.remat_block in (None, 1)
        if offloading_scan and not ours:
            wanted["xla_gpu_enable_pipelined_host_offloading"] = True
        if self.frozen_weights == "host":
            # Each fetch from host memory is an asynchronous dynamic-slice fusion. A layer makes one per packed buffer
            # (`jaxft.memory.streamed`: one per dtype, e.g. a 4-bit base's codes and scales) and per unpacked host
            # array. At the default limit XLA runs several one at a time, most waited for before any matmul (5 of a
            # layer's 7 fetches in the forward under no GEMM); with this limit each runs under at least one.
            wanted["xla_gpu_experimental_parallel_async_compute_limit"] = 8
        if ours or offloading_scan:
            # No CUDA-graph command buffers: inside one, the loop's copies from host memory run serialised with the
            # matmuls (a loop of 8B's matmuls with each layer's weights copied in under the layer before: 265 ms a
            # step with command buffers, 157 without, 147 for the compute alone).
            wanted["xla_gpu_enable_command_buffer"] = ""
        return {**wanted, **self.compiler_options}

    def replace(self, **changes) -> "ExecutionConfig":
        return dataclasses.replace(self, **changes)

    def __hash__(self) -> int:
        return hash((self.attention_implementation, self.remat, self.remat_layers, self.remat_block, self.layer_loop,
                     self.ce_chunk_size, self.mlp_chunk_size, self.max_memory_gb, self.host_memory_gb,
                     self.ce_implementation,
                     tuple(sorted(self.compiler_options.items())), self.offload_transfer,
                     self.grouped_matmul_implementation, self.moe_dispatch, self.frozen_weights))


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"
