"""Rematerialisation policies: which residuals a layer's backward pass keeps (on the device or in pinned host
memory) and which it recomputes from the layer input.

The model names the residuals worth keeping with `jax.ad_checkpoint.checkpoint_name` (`NAMES`); a policy
says, per name, "save" (kept on the device), "offload" (moved to pinned host memory after the forward, moved
back for the backward) or nothing (recomputed). Policies (`ExecutionConfig.remat`, the flat `remat` key):

    none          no checkpoint: every residual stays on the device (memory: fast; 8B 1 x 4096 H200 14,799 tok/s)
    full          keep nothing but the layer inputs (on the device); recompute the rest (auto's candidate where the
                  host is too small for the copies; 8B max context on an H200 326,656 tokens, no host memory)
    offload       layer inputs to pinned host, recompute the rest, attention included (memory: lean; 8B 1 x 4096
                  H100 10,439 tok/s at 16.89 GiB)
    offload+attn  layer inputs to pinned host, attention output + softmax statistics kept on the device, so
                  the backward never re-runs the attention forward (recomputes projections, norms, the MLP)
                  (memory: balanced; Gemma-2-9B packed 1 x 16384 H200 8,683 tok/s at 30.04 GiB)
    save=N,..;offload=N,..   selective: the named residuals kept on the device / offloaded (either part may be
                  left out); the YAML key also takes a mapping {save: [...], offload: [...]} (memory: max_context
                  is offload=layer_input,attn_out,attn_lse; 8B 1 x 16384 H100 8,366 tok/s at 6.87 GiB streamed)
    auto          chosen per run from the compiled step's memory analysis (`jaxft.run.Run.choose_remat`)

Nested (two-level) checkpointing, `remat_block` = k > 1 with "full" or "offload" (`RematPolicy.block`): the
layers run in blocks of k, each block one checkpoint that keeps only its input (`BLOCK_INPUT`: on the device
for "full", in pinned host memory for "offload"), each layer inside it a "full" checkpoint. The forward keeps
ceil(L / k) block inputs instead of L layer inputs; the backward re-runs one block's forward, which keeps that
block's k layer inputs on the device, then differentiates its layers one at a time, each recomputed from its
input. Cost: one more forward of every layer (a step is about 3 forwards' work with "full", 4 here). What it
buys: the host holds L / k layer inputs where "offload" holds L, so a row whose L layer inputs exceed the host's
memory still trains (`block_layers` picks the smallest k that fits a host budget).

Why names rather than "save dots": the attention kernels are custom VJPs (Pallas flash, cuDNN) whose
residuals (output, logsumexp) are named inside their forward rules (`kernels_pallas.attention.residuals`),
so a policy can keep exactly those and the backward runs only the attention backward kernels.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import numpy as np

from jaxft.errors import ConfigError
from jaxft.families import family_for
from jaxft.residuals import (ATTN_LSE, ATTN_OUT, ATTN_PROJ, ATTN_QKV, BLOCK_INPUT, LAYER_INPUT, MLP_GATE_UP, MLP_INPUT,
                             MLP_OUT, MOE_EXPERT_OUT, NAMES)
from kernels_pallas.attention import kept_pairs

STREAM = (LAYER_INPUT, MLP_INPUT, ATTN_PROJ, MLP_OUT)  # the [B,T,H] residuals, what `offload_stream` moves
FIXED = ("none", "full", "offload", "offload+attn", "auto")
# Layer inputs and the attention's residuals (output, softmax statistics) in pinned host memory
# (`examples/bench/lean_attn.yaml`): offload+attn's recompute at about offload's device memory.
LEAN_ATTN = f"offload={LAYER_INPUT},{ATTN_OUT},{ATTN_LSE}"
# `auto`'s candidates, in the order of expected speed (it takes the first that fits; see Run.choose_remat):
#   none          recomputes nothing;
#   offload+attn  recomputes projections/norms/MLP but not attention, copies one [B,T,H] per layer each way;
#   LEAN_ATTN     the same recompute, the attention's residuals copied too (two [B,T,H] and the statistics per
#                 layer each way): 3% faster than offload at 8B 1 x 16384; tried after offload where its copies
#                 cost more than the attention forward they spare (`attention_copies_pay`, choice.auto_order);
#   full          recomputes the whole layer, attention included, no host copies;
#   offload       the same recompute as full plus the host copies (at best hidden under compute), so never
#                 faster than full, but it keeps L fewer layer inputs on the device.
# Device memory falls along the same order up to LEAN_ATTN, which keeps about offload's; full keeps the layer inputs
# on the device, more than either. So "the first that fits" is still "the fastest that fits", and full and offload
# are there for a host too small for LEAN_ATTN's copies (`choice.host_fit` skips it; offload then nests).
AUTO_ORDER = ("none", "offload+attn", LEAN_ATTN, "full", "offload")
# What `auto` weighs when full remat on the first k layers fits and offload+attn might too (choice._partial_remat):
# full remat on k layers recomputes those layers' whole forward, attention included; offload+attn recomputes the
# projections and MLP of every layer but no attention (its host copies hide under compute). Which recomputes less
# depends on the row: attention grows with the pairs a row attends, the projections with its tokens.
# `recompute_work` prices both in matmul time; ATTENTION_RATE is the attention kernels' speed relative to dense
# matmuls in bf16 (cuDNN forward 430-570 TFLOP/s against matmuls of 620-800; the Pallas flash kernel on packed rows
# is not faster).
ATTENTION_RATE = 0.65
# How `auto` measures full remat's per-layer saving before trying it on the first k layers (choice._partial_remat):
# full remat on the first 1 and on the first 3 layers of a 4-layer copy of the model (compiled from shapes). Four
# layers are two whole periods of period 1 and 2 stacks (Llama, Qwen, Gemma 2, GPT-OSS) and the two counts differ
# by one period (a sliding and a global Gemma 2 layer); for Gemma 3 (period 6) they are its first layers, the
# ones partial remat recomputes (residual shapes do not depend on the window).
AUTO_PROBE_DEPTH, AUTO_PROBE_LAYERS = 4, (1, 3)
REMAT_HELP = ("one of " + ", ".join(repr(p) for p in FIXED) + ", or a selective policy 'save=NAME,...;offload=NAME,...'"
              " (names: " + ", ".join(NAMES) + ")")


class RematError(ConfigError):
    """A bad remat policy; the message is one line naming the valid policies and names."""


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    """A parsed policy: `kind` is "none", "full" or "names" (keep `save` on the device, `offload` on the host,
    recompute everything else)."""

    kind: str
    save: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    # How an offloaded layer input travels (ExecutionConfig.offload_transfer): "policy" (jax.checkpoint's offload
    # policy), "explicit" (jaxft.memory.offload: copies written in a custom VJP) or "auto" (explicit in unrolled loops).
    transfer: str = "auto"
    # Layers per nested-checkpoint block (module docstring); 1: each layer is its own checkpoint. Only "full"
    # and "offload" (the layer input alone kept) nest.
    block: int = 1

    @property
    def checkpointed(self) -> bool:
        return self.kind != "none"

    @property
    def offloads(self) -> bool:
        return bool(self.offload)

    @property
    def explicit_capable(self) -> bool:
        """Whether `jaxft.memory.offload` can run this policy: the layer input offloaded, nothing else kept (remat
        "offload"); its backward recomputes the whole layer, so a policy that keeps other residuals cannot."""
        return self.kind == "names" and self.offload == (LAYER_INPUT,) and not self.save

    def jax_policy(self):
        """The `jax.checkpoint` policy of one layer."""
        if self.kind == "full":
            return jax.checkpoint_policies.nothing_saveable
        if self.kind == "names":
            if not self.offload:
                return jax.checkpoint_policies.save_only_these_names(*self.save)
            return jax.checkpoint_policies.save_and_offload_only_these_names(
                names_which_can_be_saved=list(self.save), names_which_can_be_offloaded=list(self.offload),
                offload_src="device", offload_dst="pinned_host")
        raise ValueError(f"remat policy {self.kind!r} has no checkpoint policy")

    @property
    def nestable(self) -> bool:
        """Whether layers of this policy can run in nested blocks: it keeps the layer input alone (full, offload)."""
        return self.kind == "full" or self.explicit_capable

    def nested(self) -> tuple["RematPolicy", "RematPolicy"]:
        """(the policy of a block's checkpoint, that of each layer inside it) for `block` > 1: the block keeps
        its input where this policy keeps the layer input (device for full, pinned host for offload); its layers
        are full checkpoints (each keeps its input on the device while its block is differentiated)."""
        if not self.nestable:
            raise ValueError(f"remat {self.spelled()!r} does not nest (only 'full' and 'offload' do)")
        outer = RematPolicy("full") if self.kind == "full" else RematPolicy("names", offload=(BLOCK_INPUT,))
        return outer, RematPolicy("full")

    @property
    def streams(self) -> bool:
        """Whether layers of this policy run over streamed weights (`frozen_weights: host`,
        `jaxft.memory.scan_offload`): it offloads nothing but the layer input, or it keeps nothing on the device (`save`
        empty: every residual it keeps goes to the host). The scan moves those itself (`streaming`); a jax.checkpoint
        offload inside it would leave host buffers for the scan to stack, which XLA's layout assignment rejects on JAX
        0.11.2. A policy that both keeps names on the device and offloads others beside the layer input does not
        stream."""
        return set(self.offload) <= {LAYER_INPUT} or (self.kind == "names" and not self.save)

    def streaming(self):
        """For `frozen_weights: host`: (the `jax.checkpoint` policy of each layer inside the streamed scan, or None
        to recompute the whole layer from its input; whether the layer input waits in pinned host memory; whether
        what that policy keeps waits there too). An offloaded name other than the layer input is kept by the
        layer's checkpoint on the device, and the scan moves it to the host after the layer's forward and back
        one layer ahead of its backward (`offloaded_scan(residuals_host=True)`)."""
        if not self.streams:
            raise ValueError(f"remat {self.spelled()!r} keeps {', '.join(self.save)} on the device and offloads "
                             f"{', '.join(self.offload)}: over streamed weights a policy offloads only the layer "
                             "input, or keeps nothing on the device")
        on_host = LAYER_INPUT in self.offload
        if self.kind == "full" or self.explicit_capable:
            return None, on_host, False
        if self.kind == "none":
            return jax.checkpoint_policies.everything_saveable, False, False
        others = tuple(n for n in self.offload if n != LAYER_INPUT)
        if others:
            return RematPolicy("names", save=others).jax_policy(), on_host, True
        return self.without((LAYER_INPUT,)).jax_policy(), on_host, False

    def without(self, names: tuple[str, ...]) -> "RematPolicy":
        """This policy keeping none of `names` (recomputed instead)."""
        return dataclasses.replace(self, save=tuple(n for n in self.save if n not in names),
                                   offload=tuple(n for n in self.offload if n not in names))

    def spelled(self) -> str:
        """The canonical string of this policy (what `parse` reads back)."""
        if self.kind != "names":
            return self.kind
        parts = [f"{key}={','.join(names)}" for key, names in (("save", self.save), ("offload", self.offload))
                 if names]
        return ";".join(parts) or "full"


def _names(value: Any, part: str, spelled: str) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(n, str) for n in items):
        raise RematError(f"remat {spelled!r}: {part} must list residual names; valid names: {', '.join(NAMES)}")
    names = tuple(dict.fromkeys(n.strip() for n in items if n.strip()))
    bad = [n for n in names if n not in NAMES]
    if bad:
        raise RematError(f"remat {spelled!r}: unknown residual name {bad[0]!r} in {part}; valid names: "
                         f"{', '.join(NAMES)}")
    return names


def canonical(value: Any) -> str:
    """The canonical string of a remat value (a policy name, a 'save=..;offload=..' string, or a mapping with
    keys save/offload); raises RematError (one line) on anything else."""
    if isinstance(value, Mapping):
        bad = [k for k in value if k not in ("save", "offload")]
        if bad:
            raise RematError(f"remat mapping key {bad[0]!r} is not 'save' or 'offload'; {REMAT_HELP}")
        return _selective({k: _names(v, k, str(dict(value))) for k, v in value.items()}, str(dict(value)))
    if not isinstance(value, str):
        raise RematError(f"remat value {value!r} is not a policy; {REMAT_HELP}")
    if value in FIXED:
        return value
    if "=" not in value:
        raise RematError(f"remat value {value!r} is not a policy; {REMAT_HELP}")
    parts: dict[str, tuple[str, ...]] = {}
    for chunk in value.split(";"):
        key, sep, names = chunk.partition("=")
        key = key.strip()
        if not sep or key not in ("save", "offload") or key in parts:
            raise RematError(f"remat value {value!r}: expected 'save=NAME,...;offload=NAME,...' (each part once); "
                             f"{REMAT_HELP}")
        parts[key] = _names(names, key, value)
    return _selective(parts, value)


def _selective(parts: Mapping[str, tuple[str, ...]], spelled: str) -> str:
    save, offload = tuple(parts.get("save", ())), tuple(parts.get("offload", ()))
    both = set(save) & set(offload)
    if both:
        raise RematError(f"remat {spelled!r}: {sorted(both)[0]!r} is both saved and offloaded; name it in one part")
    return RematPolicy("names", save, offload).spelled()


def parse(value: str) -> RematPolicy:
    """The policy of a canonical remat string ("auto" must be resolved first)."""
    value = canonical(value)
    if value in ("none", "full"):
        return RematPolicy(value)
    if value == "offload":
        return RematPolicy("names", offload=(LAYER_INPUT,))
    if value == "offload+attn":
        return RematPolicy("names", save=(ATTN_OUT, ATTN_LSE), offload=(LAYER_INPUT,))
    if value == "auto":
        raise ValueError("remat 'auto' is resolved by jaxft.run.Run.choose_remat before the step is built")
    save, offload = (), ()
    for chunk in value.split(";"):
        key, _, names = chunk.partition("=")
        if key == "save":
            save = tuple(names.split(","))
        else:
            offload = tuple(names.split(","))
    return RematPolicy("names", save, offload)


def residual_bytes(cfg, batch: int, seq: int, itemsize: int, mlp_chunk_size: int | None = None) -> dict[str, int]:
    """Bytes of each named residual of ONE layer for a [batch, seq] micro-batch (activation dtype `itemsize`).
    With a tiled MLP (`mlp_chunk_size` < seq) the layer keeps nothing under `MLP_GATE_UP` (`tiled_mlp_names`)."""
    tokens = batch * seq
    heads, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    stream = tokens * cfg.hidden_size * itemsize
    sandwich = stream if family_for(cfg.model_type).parts.sandwich_norms else 0  # kept where an output norm reads them
    tiled = tiled_mlp_names(seq, mlp_chunk_size)
    # A mixture of experts keeps gate/up for each of its k sorted rows per token at the experts' width; a mixed
    # model's dense layers (Qwen3-MoE's mlp_only_layers) at theirs: every layer is counted at the wider of the two.
    width = cfg.intermediate_size
    if cfg.num_experts:
        width = max(width, cfg.num_experts_per_tok * cfg.moe_intermediate_size)
    return {
        LAYER_INPUT: stream,
        MLP_INPUT: stream,
        ATTN_PROJ: sandwich,
        MLP_OUT: sandwich,
        ATTN_OUT: tokens * heads * d * itemsize,
        ATTN_LSE: tokens * heads * 4,
        ATTN_QKV: tokens * (heads + 2 * kv) * d * itemsize,
        MLP_GATE_UP: 0 if MLP_GATE_UP in tiled else 2 * tokens * width * itemsize,
        MOE_EXPERT_OUT: tokens * cfg.num_experts_per_tok * cfg.hidden_size * itemsize if cfg.num_experts else 0,
    }


def tiled_mlp_names(seq: int, mlp_chunk_size: int | None) -> tuple[str, ...]:
    """The residual names a layer of `seq` tokens cannot keep because its MLP runs in chunks of `mlp_chunk_size`
    (`jaxft.models.parts.tiled_mlp`: each chunk under a save-nothing checkpoint inside a loop, so the MLP's
    gate/up exist one chunk at a time and are recomputed in the backward); none when the MLP is one call.
    A policy naming them there would ask XLA to keep a value of the inner loop outside it (for an offload, XLA
    0.11.2 fails its layout assignment), and would hold [T, intermediate] again."""
    return (MLP_GATE_UP,) if mlp_chunk_size is not None and mlp_chunk_size < seq else ()


def block_layers(num_layers: int, layer_input_bytes: int, host_budget_bytes: int | None) -> int:
    """`remat_block: auto`: layers per nested block. With a host budget (remat offload), the smallest k whose
    ceil(L / k) block inputs fit it (L when none does: one block input is all that can go); without one (remat
    full, where block inputs stay on the device), ceil(sqrt(L)), which minimises L / k + k layer inputs held."""
    if host_budget_bytes is None:
        return max(1, math.ceil(math.sqrt(num_layers)))
    for k in range(1, num_layers + 1):
        if math.ceil(num_layers / k) * layer_input_bytes <= host_budget_bytes:
            return k
    return num_layers


def host_memory_bytes() -> int:
    """This machine's physical memory (MemTotal)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo; set host_memory_gb")


def default_host_budget(total_bytes: int | None = None) -> int:
    """Host bytes offloaded residuals may take when `host_memory_gb` is not given: the machine's memory (or
    `total_bytes`) less max(8 GiB, 10%) for the process itself (its copy of the weights while loading, the data
    pipeline, the runtime)."""
    total = host_memory_bytes() if total_bytes is None else total_bytes
    return int(total - max(8 * 2**30, 0.1 * total))


def offloaded_bytes(policy: RematPolicy, cfg, batch: int, seq: int, itemsize: int,
                    mlp_chunk_size: int | None = None) -> int:
    """Host bytes a step of `policy` keeps for its backward: each offloaded name's `residual_bytes` x layers, or
    with nested blocks (`policy.block` > 1) one layer input per block, ceil(L / k) of them."""
    sizes = residual_bytes(cfg, batch, seq, itemsize, mlp_chunk_size)
    if policy.block > 1:
        return math.ceil(cfg.num_layers / policy.block) * sizes[LAYER_INPUT] if policy.offloads else 0
    return sum(sizes[n] for n in policy.offload) * cfg.num_layers


def recompute_work(cfg, segment_ids) -> list[tuple[float, float]]:
    """Per layer, (projections + MLP, attention): the forward work a layer's remat recomputes on a batch whose
    rows carry `segment_ids` [B, T], in dense-matmul FLOPs (attention's divided by ATTENTION_RATE). Projections:
    2 FLOPs per weight per token over q, k, v, o and the MLP a token runs (a dense gated MLP's three matrices, or
    the router and its top-k experts'); attention: QK^T and PV, 4 D per kept pair and query head (`kept_pairs`
    under the layer's window). LoRA's factors and the norms are left out (under 1% of either)."""
    tokens = int(np.size(segment_ids))
    h, d = cfg.hidden_size, cfg.head_dim
    attention_weights = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
    pairs = {w: kept_pairs(segment_ids, w) for w in set(cfg.layer_windows)}
    out = []
    for window, mlp in zip(cfg.layer_windows, cfg.layer_mlps):
        if mlp == "glu":
            mlp_weights = 3 * h * cfg.intermediate_size
        else:  # a router over the experts, then each token's top-k experts (gate, up, down)
            mlp_weights = h * cfg.num_experts + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
        out.append((2.0 * tokens * (attention_weights + mlp_weights),
                    4.0 * pairs[window] * cfg.num_heads * d / ATTENTION_RATE))
    return out


# A host copy priced in matmul time: the dense-matmul FLOPs the H200 runs while its host link moves one byte (bf16
# matmuls at about 700 TFLOP/s over pinned host <-> device at about 53 GB/s).
HOST_COPY_FLOPS_PER_BYTE = 700e12 / 53e9


def attention_copies_pay(cfg, segment_ids, itemsize: int) -> tuple[bool, float, float]:
    """Whether LEAN_ATTN (the attention's output and statistics copied to pinned host memory beside the layer
    input) is expected to beat offload (the same copies of the layer input, the attention recomputed) on a batch
    whose rows carry `segment_ids` [B, T]: (it pays, the attention forward its backward skips, the time of its extra
    copies), both summed over the layers in dense-matmul FLOPs: the attention term of `recompute_work`, and the
    extra residuals' bytes (`residual_bytes`) one way times HOST_COPY_FLOPS_PER_BYTE (the copies back use the
    link's other direction, during the backward).

    Why a price and not an order: a copy hides under compute only when the layer's compute lasts longer, and what
    it saves is the attention forward, which shrinks with the pairs a row attends: at 8B 1 x 16384 (one document)
    the attention is 108 TFLOP-equivalents a step against copies worth 58 (LEAN_ATTN wins); at GPT-OSS-20B packed
    1 x 16384 (documents of ~306 tokens, 128-token windows on half the layers), 2 against 44 (offload wins)."""
    b, t = np.shape(segment_ids)
    sizes = residual_bytes(cfg, b, t, itemsize)
    saved = sum(a for _, a in recompute_work(cfg, segment_ids))
    copies = cfg.num_layers * (sizes[ATTN_OUT] + sizes[ATTN_LSE]) * HOST_COPY_FLOPS_PER_BYTE
    return saved > copies, saved, copies


def partial_full_limit(work: list[tuple[float, float]]) -> int:
    """The most first layers full remat may take before offload+attn recomputes less: the largest k with
    sum over layers < k of (projections + attention) <= sum over all layers of projections (`recompute_work`)."""
    budget = sum(p for p, _ in work)
    spent, k = 0.0, 0
    for p, a in work:
        spent += p + a
        if spent > budget:
            break
        k += 1
    return k
