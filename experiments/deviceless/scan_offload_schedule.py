"""Where XLA schedules a layer scan's host-offload copies, compiled for an H200 on a CPU machine (no GPU time).

A 4-layer toy scan (layer: tanh(x @ W) + x, 1 x 2048 x 1024 bf16) whose layer inputs go to pinned host memory, three ways:

    policy        jax.checkpoint's offload policy in the scan (what remat "offload" runs in the layer scan)
    policy+pho    the same with xla_gpu_enable_pipelined_host_offloading (ExecutionConfig.program_options' default)
    prefetch      a hand-written custom VJP around the scan: the forward stacks device_put(x, Host) as a scan output;
                  the backward, a reverse scan, starts the copy back of layer i - 1's input before layer i's vjp and
                  carries it into the next iteration

For each, the while bodies that touch host memory (S(5)) are printed in schedule order with the number of GEMMs between
each async copy's start and its done: 0 means the copy is waited for before any compute (exposed on the GPU).

What it showed (JAX 0.11.2, docs/benchmarks.md section 23): policy, forward 0 and backward 0; policy+pho, forward 1
(the copy of iteration i's input waits behind iteration i + 1's matmul) and backward 0; prefetch, forward 1 and
backward 3 (the whole layer backward runs under the copy back). Device temp 20.0 / 20.0 / 34.0 MiB: the prefetch
holds a second layer input (4 MiB here) and more of the loop's buffers, not yet looked at. So hiding the
backward's copies in this toy needs the hand-written form (`jaxft/memory/scan_offload.py`, opt-in). In 4 Llama layers of
2048 width at 1 x 4096 compiled the same way, XLA overlapped the policy's copy back with 43 GEMMs: the toy
overstates the problem at real sizes.

    python -m pip install --target /tmp/jax_cuda jax-cuda13-plugin==$(python -c "import jax; print(jax.__version__)")
    PYTHONPATH=/tmp/jax_cuda python -m experiments.deviceless.scan_offload_schedule
"""

from __future__ import annotations

import os
import sys

from experiments.deviceless.gpu_compile import compile_for_h200  # noqa: E402  (sets the CUDA plugin up first)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.ad_checkpoint import checkpoint_name  # noqa: E402

from tests.hlo_text import schedules  # noqa: E402

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device
L, T, H = 4, 2048, 1024
PHO = {"xla_gpu_enable_pipelined_host_offloading": True}


def layer(x, w):
    return jnp.tanh(x @ w) + x


def policy_stack(x, ws):
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["x"], offload_src="device",
        offload_dst="pinned_host")
    step = jax.checkpoint(lambda c, w: layer(checkpoint_name(c, "x"), w), policy=policy)
    return jax.lax.scan(lambda c, w: (step(c, w), None), x, ws)[0]


@jax.custom_vjp
def prefetch_stack(x, ws):
    return jax.lax.scan(lambda c, w: (layer(c, w), None), x, ws)[0]


def _prefetch_fwd(x, ws):
    y, xs_host = jax.lax.scan(lambda c, w: (layer(c, w), jax.device_put(c, HOST)), x, ws)
    return y, (xs_host, ws)


def _prefetch_bwd(res, dy):
    xs_host, ws = res

    def body(carry, inputs):
        dy, x = carry
        w, i = inputs
        # The copy back of the layer below starts here; its result is needed only by the next iteration.
        below = jax.device_put(jax.lax.dynamic_index_in_dim(xs_host, jnp.maximum(i - 1, 0), keepdims=False), DEVICE)
        dx, dw = jax.vjp(layer, x, w)[1](dy)
        return (dx, below), dw

    first = jax.device_put(xs_host[L - 1], DEVICE)
    (dx, _), dws = jax.lax.scan(body, (dy, first), (ws, jnp.arange(L)), reverse=True)
    return dx, dws


prefetch_stack.defvjp(_prefetch_fwd, _prefetch_bwd)


def main() -> int:
    x = jax.ShapeDtypeStruct((T, H), jnp.bfloat16)
    ws = jax.ShapeDtypeStruct((L, H, H), jnp.bfloat16)
    for name, stack, options in (("policy", policy_stack, {}), ("policy+pho", policy_stack, PHO),
                                 ("prefetch", prefetch_stack, PHO)):
        grad = jax.grad(lambda x, ws: jnp.sum(stack(x, ws).astype(jnp.float32)), argnums=1)
        compiled = compile_for_h200(grad, x, ws, compiler_options=options)
        mem = compiled.memory_analysis()
        print(f"{name}: device temp {mem.temp_size_in_bytes / 2**20:.1f} MiB, host temp "
              f"{mem.host_temp_size_in_bytes / 2**20:.1f} MiB")
        for body, copies in schedules(compiled.as_text()):
            print(f"  {body}: " + ", ".join(f"{c} with {n} GEMMs before its done" for c, n in copies))
    return 0


if __name__ == "__main__":
    sys.exit(main())
