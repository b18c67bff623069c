"""The fp8_matmul op's forward and input gradient compiled for an H200 on a CPU-only machine (no GPU time): which
GEMM custom calls XLA makes of the f8 x f8 dots, on the Llama-3.1-8B projections at 4096 tokens and on a row count
that is no multiple of 16.

    python -m pip install --target /tmp/jax_cuda jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2 --no-deps
    PYTHONPATH=.:/tmp/jax_cuda JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python experiments/fp8_deviceless.py

XLA's GEMM rewriter makes an FP8 cuBLASLt call only when it knows the CUDA toolkit is 12.0 or newer; compiled
without a device that version is 0 unless the target description carries `runtime_version`, and the f8 dots become
f16 GEMMs on upcast operands (a copy of every weight in f16). The target here is scripts/deviceless/h200_target.txtpb
plus `runtime_version { major: 12 minor: 8 }`; on a GPU the runtime supplies it. With XLA's Triton GEMMs on (its
default) the f8 dots become Triton GEMM fusions reading the f8 operands instead (XLA's heuristic here; on a GPU
autotuning picks between those and cuBLASLt).
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from kernels_pallas.fp8_matmul.fp8 import fp8_matmul_fp8
from kernels_pallas.fp8_matmul.xla import fp8_matmul_dequant

REPO = Path(__file__).resolve().parents[1]
SHAPES = ((4096, 14336, 4096), (4096, 4096, 14336), (4096, 1024, 4096), (1000, 1024, 4096))  # (tokens, out, in)
CALL = re.compile(r'custom_call_target="([^"]+)"')
TRITON_F8 = re.compile(r"\n%gemm_fusion\S*_computation \([\w.]+: f8e4m3fn\[[\d,]+\], [\w.]+: f8e4m3fn\[")


def _compile(fn, args, runtime: bool, triton: bool):
    target = (REPO / "scripts" / "deviceless" / "h200_target.txtpb").read_text()
    if runtime:
        target += "\nruntime_version { major: 12 minor: 8 patch: 0 }\n"
    topology = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=target,
                                            topology="1x1x1")
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    whole = NamedSharding(mesh, PartitionSpec())
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole) for a in args]
    with jax.set_mesh(mesh):
        lowered = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
    return lowered.compile({"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": triton})


def _step(matmul):
    def run(x, q, scale, dy):
        y, pullback = jax.vjp(lambda a: matmul(a, q, scale), x)
        return y, pullback(dy)[0]
    return run


def main() -> None:
    for m, out_f, in_f in SHAPES:
        args = (jax.ShapeDtypeStruct((m, in_f), jnp.bfloat16), jax.ShapeDtypeStruct((out_f, in_f), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((out_f,), jnp.float32), jax.ShapeDtypeStruct((m, out_f), jnp.bfloat16))
        for name, matmul, runtime, triton in (
                ("xla_fp8, cuBLAS", fp8_matmul_fp8, True, False),
                ("xla_fp8, cuBLAS, no runtime_version", fp8_matmul_fp8, False, False),
                ("xla_fp8, Triton GEMMs on", fp8_matmul_fp8, True, True),
                ("xla (dequantised bf16), cuBLAS", fp8_matmul_dequant, True, False)):
            compiled = _compile(_step(matmul), args, runtime, triton)
            text = compiled.as_text()
            calls = [c for c in CALL.findall(text) if "cublas" in c]
            f8_triton = len(TRITON_F8.findall(text))
            f8_transposes = len(re.findall(r"f8e4m3fn\[\d+,\d+\]\{1,0\} transpose\(", text))
            print(f"{m:5d} x [{out_f}, {in_f}] {name:38s} cuBLAS {calls} Triton f8 GEMM fusions {f8_triton} "
                  f"f8 transposes {f8_transposes} temp {compiled.memory_analysis().temp_size_in_bytes / 2**20:.0f} MiB")

if __name__ == "__main__":
    main()
