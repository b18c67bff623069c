"""Where XLA schedules the weight fetches of `frozen_weights: host` (`jaxft.memory.scan_offload.HostRows`), compiled for
an H200 on a CPU machine (no GPU time): four Llama-3.1-8B layers (q, k, v, o 4096 x 4096, gate/up 4096 x 14336, down
14336 x 4096, bf16; attention stood in for by two matmuls), 1 x 4096, LoRA on q, remat full over streamed weights.

Three forms:
    per-leaf        each weight its own host stack, one fetch per weight and layer (what jaxft streams today)
    per-leaf+limit  the same with xla_gpu_experimental_parallel_async_compute_limit 8 (`ExecutionConfig.program_options`
                    sets it with frozen_weights: host)
    packed          the layer's weights as one host row, one fetch per layer, sliced on the device

For each, the while bodies that touch host memory are printed with the GEMMs between each fetch's start and its done:
0 means the fetch is waited for before any compute of the iteration (exposed on the GPU, unless compute is queued).

The compile target has no host memory space of its own (the topology's devices list no memories), so the
weights enter on the device and the program's first op copies them to pinned host: its argument size counts them
on the device, which the step does not (there they are host arguments).

What it showed (JAX 0.11.2, docs/benchmarks.md section 36): per-leaf, forward fetches under 0,0,0,0,0,2,9 GEMMs
and backward 0,0,0,0,0,17,19 (XLA runs the fetches one at a time); per-leaf+limit, forward 1,1,1,1,1,2,9 and
backward 2,3,14,15,16,17,19; packed, forward 9 (all) and backward 19 (all), at 0.45 GiB more temp (the device-side
slices of one layer's row).

    PYTHONPATH=/tmp/jax_cuda python -m experiments.deviceless.stream_schedule
"""

from __future__ import annotations

import os
import sys

from experiments.deviceless.gpu_compile import compile_for_h200  # noqa: E402  (sets the CUDA plugin up first)
from tests.hlo_text import schedules  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxft.memory.scan_offload import HostRows, offloaded_scan  # noqa: E402

HOST = jax.memory.Space.Host
L, T, H, I, R = 4, 4096, 4096, 14336, 16
SHAPES = {"q": (H, H), "k": (H, H), "v": (H, H), "o": (H, H), "g": (H, I), "u": (H, I), "d": (I, H)}
PACKED = sum(a * b for a, b in SHAPES.values())
PIPELINED = {"xla_gpu_enable_pipelined_host_offloading": True}
LIMIT = {"xla_gpu_experimental_parallel_async_compute_limit": 8}


def layer(c, xs):
    w, a, _ = xs
    if not isinstance(w, dict):  # one packed row: slice it on the device
        flat, w, at = w, {}, 0
        for name, (rows, cols) in SHAPES.items():
            w[name], at = flat[at:at + rows * cols].reshape(rows, cols), at + rows * cols
    q = c @ w["q"] + (c @ a[0]) @ a[1]
    x = c + (jnp.tanh(q @ w["k"]) @ w["v"]) @ w["o"]
    return x + (jax.nn.silu(x @ w["g"]) * (x @ w["u"])) @ w["d"]


def loss(lora, x, weights):
    weights = jax.tree.map(lambda t: jax.device_put(t, HOST), weights)  # stands in for host arguments (docstring)
    streamed = jax.tree.map(HostRows, weights)
    y = offloaded_scan(layer, x, (streamed, lora, jnp.arange(L)), host=False)
    return jnp.sum(y.astype(jnp.float32))


def main() -> int:
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    lora, x = (S((L, H, R), bf), S((L, R, H), bf)), S((T, H), bf)
    per_leaf = {k: S((L, *shape), bf) for k, shape in SHAPES.items()}
    for name, weights, options in (("per-leaf", per_leaf, PIPELINED), ("per-leaf+limit", per_leaf, PIPELINED | LIMIT),
                                   ("packed", S((L, PACKED), bf), PIPELINED)):
        compiled = compile_for_h200(jax.grad(loss), lora, x, weights, compiler_options=options)
        mem = compiled.memory_analysis()
        print(f"{name}: device temp {mem.temp_size_in_bytes / 2**30:.2f} GiB")
        for body, copies in schedules(compiled.as_text()):
            print(f"  {body}: GEMMs under each fetch {[n for _, n in copies]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
