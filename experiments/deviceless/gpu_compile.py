"""Compile a jitted function for an H200 on a CPU-only machine (no GPU, no GPU time): XLA's real GPU passes,
schedule, buffer assignment and memory analysis, for diagnosing device memory (e.g. the unrolled host offload
of docs/benchmarks.md section 14 was found and fixed this way). Not used by jaxft or the tests.

Needs the CUDA PJRT plugin of the installed JAX, outside the project's venv (about 400 MB):

    python -m pip install --target /tmp/jax_cuda jax-cuda13-plugin==$(python -c "import jax; print(jax.__version__)")
    PYTHONPATH=/tmp/jax_cuda python -m experiments.deviceless.gpu_compile     # a self-check

(the script sets JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1: without it the plugin's start-up check calls cuInit, which fails
on a machine without a GPU, and JAX falls back to the CPU backend alone).

`compile_for_h200(fn, *args, compiler_options=None)` takes arrays or ShapeDtypeStructs and returns the compiled
executable (`.memory_analysis()`, `.as_text()`; pass `xla_dump_to` in `compiler_options` for buffer dumps).
The target description `h200_target.txtpb` was written from XLA's H200 device spec (132 SMs, 141 GB, compute
capability 9.0, cuDNN 9.10): autotuning cannot run without a device (compile with `xla_gpu_autotune_level` 0),
and cuDNN kernels need cuDNN installed here (use attention "pallas" or "xla" otherwise).

Pallas kernels choose interpret mode from the platform being traced for (`kernels_pallas._dispatch.target_platform`:
the mesh set with `jax.set_mesh`, as `jaxft.run.Run.compile` does with its devices, else `jax_default_device`).
Trace under the target's mesh (or `with jax.default_device(h200_device())` around a bare `.lower()`) and they lower
for the GPU (Triton for the flash attention). Otherwise the program holds the CPU interpreter's loops and
NaN-filled output buffers: compiled that way, Gemma-3-12B at 1 x 16384 kept 36 of them, [16384, 16, 256] bf16
(4.5 GiB), live on 12 unrolled layers, about 0.37 GiB per layer the GPU program does not have (docs/benchmarks.md
section 18; before the platform came from the mesh, every deviceless `Run.compile` was of that kind). The Mosaic
GPU kernels (grouped matmul) do not lower here at all.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# The CUDA plugin comes from PYTHONPATH (the folder pip installed it into); without a GPU its start-up check must
# not call cuInit.
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402


def h200_device():
    """The H200 target's device (for `jax.default_device` around a bare `.lower()`: eager operations cannot run
    on it, so never make it the process's default)."""
    return h200_topology().devices[0]


def h200_topology():
    with open(os.path.join(HERE, "h200_target.txtpb")) as f:
        target = f.read()
    return topologies.get_topology_desc(platform="cuda", topology_name="", target_config=target, topology="1x1x1")


def compile_for_h200(fn, *args, compiler_options=None):
    mesh = topologies.make_mesh(h200_topology(), (1,), ("x",))
    replicated = NamedSharding(mesh, PartitionSpec())
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), args)
    jitted = jax.jit(fn, in_shardings=jax.tree.map(lambda _: replicated, args))
    with jax.set_mesh(mesh):  # the traced platform is the target's (Pallas kernels lower for it)
        lowered = jitted.trace(*shapes).lower(lowering_platforms=("cuda",))
    return lowered.compile(
        {"xla_gpu_autotune_level": 0, **(compiler_options or {})})


if __name__ == "__main__":
    import jax.numpy as jnp

    def f(x):  # a value moved to pinned host and back: its copies must show as memory space 5 (S(5))
        h = jax.lax.optimization_barrier(jax.device_put(x * 2, jax.memory.Space.Host))
        return (jnp.sin(x) @ x.T).sum() + jax.device_put(h, jax.memory.Space.Device).sum()

    compiled = compile_for_h200(f, jax.ShapeDtypeStruct((256, 256), jnp.float32))
    print(compiled.memory_analysis())
    host = [line for line in compiled.as_text().splitlines() if "S(5)" in line]
    print(f"{len(host)} instructions in host memory")
    sys.exit(0 if host else 1)
