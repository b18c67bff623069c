"""bf16 matmul ceiling: the best FLOP/s a square bf16 matmul reaches on this device.

MFU in the benchmark is reported against this measured number (not a datasheet peak), so the
ratio says how close a training step gets to what the same chip and libraries can do on the
easiest possible kernel. For an n x n x n matmul: FLOPs = 2 n^3; the ceiling is the maximum over
the sizes tried of 2 n^3 * iters / seconds, each size timed in several trials and the best kept: the
first timed loops after a process starts can run far below the chip's rate (on the H200, JAX's 4096 and
8192 read 236 and 502 TFLOP/s in a single trial, 747 and 809 in a warm process), and a ceiling read low
inflates every MFU divided by it.

Runnable on its own (this module imports nothing from the rest of the benchmark package, so the harness can
start it in its own process for each framework):

    python -m scripts.bench.ceiling --framework {torch,jax} --device {cpu,cuda} --out RESULT.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any, Callable

GPU_SIZES = (4096, 8192, 16384)
CPU_SIZES = (256, 512)


def _best_rate(run: Callable[[], None], flops: float, trials: int) -> float:
    """flops / seconds of `run` (which must end synchronised), the best of `trials` timings."""
    best = 0.0
    for _ in range(trials):
        t0 = time.perf_counter()
        run()
        best = max(best, flops / (time.perf_counter() - t0))
    return best


def torch_ceiling(device: str, sizes: tuple[int, ...], iters: int, trials: int) -> dict[str, Any]:
    import torch

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    per_size = {}
    for n in sizes:
        a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
        b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
        for _ in range(3):  # warm-up: cuBLAS heuristics, clocks
            torch.matmul(a, b)
        sync()

        def run():
            for _ in range(iters):
                torch.matmul(a, b)
            sync()

        per_size[str(n)] = _best_rate(run, 2.0 * n ** 3 * iters, trials)
        del a, b
    info = {"device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda"
            else f"cpu ({platform.machine()})",
            "versions": {"torch": torch.__version__, "cuda": torch.version.cuda}}
    return {"flops_per_s": max(per_size.values()), "per_size": per_size, **info}


def jax_ceiling(device: str, sizes: tuple[int, ...], iters: int, trials: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    dev = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    matmul = jax.jit(lambda x, y: jnp.matmul(x, y))
    per_size = {}
    for n in sizes:
        ka, kb = jax.random.split(jax.random.key(0))
        a = jax.device_put(jax.random.normal(ka, (n, n), jnp.bfloat16), dev)
        b = jax.device_put(jax.random.normal(kb, (n, n), jnp.bfloat16), dev)
        for _ in range(3):  # warm-up includes the compile
            matmul(a, b).block_until_ready()

        def run():
            out = [matmul(a, b) for _ in range(iters)]
            for o in out:
                o.block_until_ready()

        per_size[str(n)] = _best_rate(run, 2.0 * n ** 3 * iters, trials)
        del a, b
    import jaxlib
    return {"flops_per_s": max(per_size.values()), "per_size": per_size,
            "device_name": dev.device_kind,
            "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=("torch", "jax"), required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--iters", type=int, default=0, help="0: 20 on cuda, 3 on cpu")
    p.add_argument("--trials", type=int, default=0, help="timings per size, the best kept; 0: 3 on cuda, 1 on cpu")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    sizes = GPU_SIZES if args.device == "cuda" else CPU_SIZES
    iters = args.iters or (20 if args.device == "cuda" else 3)
    trials = args.trials or (3 if args.device == "cuda" else 1)
    fn = torch_ceiling if args.framework == "torch" else jax_ceiling
    try:
        result = {"status": "ok", "framework": args.framework, "iters": iters, "trials": trials,
                  **fn(args.device, sizes, iters, trials)}
    except Exception as e:  # recorded, not raised: the harness falls back to the other framework
        result = {"status": "error", "framework": args.framework,
                  "error": f"{type(e).__name__}: {e}"}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
