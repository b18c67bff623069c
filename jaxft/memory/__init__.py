"""The memory wing: how a step trades speed for device memory, and the choice of that trade.

- `execution`: `ExecutionConfig`, how a step runs (remat, layer loop, chunks, kernels, where the frozen weights
  live), and the `memory` presets;
- `policy`: the rematerialisation policies (what a layer's backward keeps, offloads or recomputes), their residual
  bytes and the order `remat: auto` tries them in;
- `budget`: the memory there is (device, host, the allocator's room) and a compiled step's peak estimate;
- `choice`: the automatic choices (`mesh: auto`, `remat: auto`, the allocator re-fit) as functions over a compile
  callback;
- `offload`, `scan_offload`: host copies of layer inputs written out (unrolled layers, the layer scan);
- `streamed`: the frozen weights packed in pinned host memory (`frozen_weights: host`).

`offload`, `scan_offload` and `streamed` serve the model's layer loops (`jaxft.models.stack`) and are imported by
their module names; this package re-exports the rest.
"""

from jaxft.memory.budget import (GIB, GPU_MEMORY_FRACTION, claim_gpu_memory, contiguous_room, default_memory_budget,
                                 host_available_memory, peak_estimate, step_budget)
from jaxft.memory.choice import (STREAMED, Compiled, Decision, MemoryBudgetError, Target, Trials, candidate_name,
                                 choose_mesh, choose_remat, fit_allocator)
from jaxft.memory.execution import MEMORY_PRESETS, ExecutionConfig, ExecutionConfigError
from jaxft.memory.policy import AUTO_ORDER, RematError, RematPolicy

__all__ = [
    "AUTO_ORDER", "GIB", "GPU_MEMORY_FRACTION", "MEMORY_PRESETS", "STREAMED", "Compiled", "Decision",
    "ExecutionConfig", "ExecutionConfigError", "MemoryBudgetError", "RematError", "RematPolicy", "Target", "Trials",
    "candidate_name", "choose_mesh", "choose_remat", "claim_gpu_memory", "contiguous_room", "default_memory_budget",
    "fit_allocator", "host_available_memory", "peak_estimate", "step_budget",
]
