"""How much memory a step may use and how much it needs: the share of each GPU JAX's allocator takes
(`claim_gpu_memory`), the host's available memory (`host_available_memory`: MemAvailable, capped by a memory
cgroup), the device budget `remat: auto` and `mesh: auto` plan in (`step_budget`, by default
`default_memory_budget`), a compiled step's device peak (`peak_estimate`) and the room one buffer can still
take on a device (`contiguous_room`).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
from jax._src import xla_bridge  # no public way to ask whether the backends have started
from jax.experimental import multihost_utils

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


def contiguous_room(stats: dict[str, int]) -> int | None:
    """Bytes one new buffer can take on a device, from its `memory_stats()`: the larger of the allocator's largest
    free block and what its limit leaves for a new region beside its pool; None when the device does not report a
    pool (the CPU)."""
    if "bytes_limit" not in stats or "pool_bytes" not in stats:
        return None
    return max(int(stats.get("largest_free_block_bytes", 0)), int(stats["bytes_limit"]) - int(stats["pool_bytes"]))



def step_budget(max_memory_gb: float | None, devices, host_memory=host_available_memory) -> tuple[int, str]:
    """(bytes, where from) a step may plan to use on each of `devices`: `max_memory_gb`, else the free memory of
    this process's first device less a margin (`default_memory_budget`; CPU devices share the host's available
    memory, `host_memory()`, so each gets its share); several processes take the smallest of theirs, so that every
    process chooses the same step."""
    if max_memory_gb is not None:
        return int(max_memory_gb * GIB), "max_memory_gb"
    local = [d for d in devices if d.process_index == jax.process_index()]
    on_host = host_is_device(local[0])
    budget, source = default_memory_budget(local[0], sharing=len(local) if on_host else 1,
                                           host=host_memory() if on_host else None)
    if jax.process_count() > 1:
        budget = int(np.min(multihost_utils.process_allgather(np.int64(budget))))
        source += f", the smallest of {jax.process_count()} processes"
    return budget, source
