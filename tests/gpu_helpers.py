"""Helpers shared by the `gpu`-marked tests (no tests here).

`NO_AUTOTUNE`: XLA's GEMM autotuning took 12-23 s per compiled program on the H200 (measured) and changes which
GEMM algorithm runs, not the math, so the GPU tests compile without it (the training tests pass it as the step's
`compiler_options`). `compile_no_autotune(fn, *args)` is `jax.jit(fn)` lowered for `args` and compiled so.
"""

from __future__ import annotations

import jax

NO_AUTOTUNE = {"xla_gpu_autotune_level": 0}


def compile_no_autotune(fn, *args):
    return jax.jit(fn).lower(*args).compile(compiler_options=NO_AUTOTUNE)
