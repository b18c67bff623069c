"""Helpers shared by the `gpu`-marked tests (no tests here).

`NO_AUTOTUNE`: XLA's GEMM autotuning took 12-23 s per compiled program on the H200 (measured) and changes which
GEMM algorithm runs, not the math, so the GPU tests compile without it. The tests that read compiled memory sizes
(tests/test_remat_gpu.py) compile with `NO_AUTOTUNE` alone: the GEMM emitter changes the schedule, and with it what
is live (a 2-layer step compiled for an H200 target: the host offload saves more than full remat with XLA's Triton
GEMM fusions, and less than full remat with cuBLAS GEMMs, in the layer scan and unrolled).

`FAST_COMPILE`: `NO_AUTOTUNE` and cuBLAS for every GEMM (`xla_gpu_enable_triton_gemm` off), for the tests that
check values and which kernels are in the program: XLA's Triton GEMM fusions are code-generated and compiled one
by one (39 of the 145 kernels of a small 2-layer step; its compile took 35 % less without them, compiled for an H200
target on a CPU); both emitters accumulate in fp32, and the kernels under test are ours. The training tests pass it
as the step's `compiler_options`. `compile_fast(fn, *args)` is `jax.jit(fn)` lowered for `args` and compiled so.
"""

from __future__ import annotations

import jax

NO_AUTOTUNE = {"xla_gpu_autotune_level": 0}
FAST_COMPILE = {**NO_AUTOTUNE, "xla_gpu_enable_triton_gemm": False}


def compile_fast(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)


def compile_no_autotune(fn, *args):
    """As `compile_fast`, XLA's GEMM emitters left as they are: for the MoE step, whose reference is
    `lax.ragged_dot` as XLA lowers it in training (grouped GEMMs)."""
    return jax.jit(fn).lower(*args).compile(compiler_options=NO_AUTOTUNE)
