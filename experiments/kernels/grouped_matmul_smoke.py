"""Smoke check of the Mosaic GPU grouped matmul: forward, d lhs and d rhs on one small ragged bf16 shape
(an empty group, tails that are no multiple of a tile, rows past the last group) against the reference.

    python -m experiments.kernels.grouped_matmul_smoke            # on the GPU (on CPU: Mosaic GPU's interpreter)

Prints one line per quantity (max |error| / max |reference|), then OK or FAIL; exceptions are printed whole.
Exit status 0 iff OK.
"""

from __future__ import annotations

import sys
import traceback

import jax
import jax.numpy as jnp

from kernels_pallas.grouped_matmul.api import grouped_matmul
from kernels_pallas.grouped_matmul.shapes import GmmShape, make_inputs

SHAPE = GmmShape("smoke", (130, 0, 77, 256, 1), 512, 256, 384, "bfloat16")
TOL = 2e-2  # bf16 operands and output, relative to the largest reference entry


def main() -> int:
    print(f"devices: {jax.devices()}", flush=True)
    lhs, rhs, sizes, dout = make_inputs(SHAPE)

    def run(impl):
        out, pullback = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes, implementation=impl), lhs, rhs)
        return (out, *pullback(dout))

    try:
        got = jax.jit(lambda: run("pallas_mosaic"))()
        want = jax.jit(lambda: run("reference"))()
        ok = True
        for name, g, w in zip(("out", "d lhs", "d rhs"), got, want):
            g, w = g.astype(jnp.float32), w.astype(jnp.float32)
            err, scale = float(jnp.max(jnp.abs(g - w))), float(jnp.max(jnp.abs(w)))
            good = err <= TOL * max(scale, 1.0)
            ok &= good
            print(f"{name:6s} max|err| {err:.4g}  max|ref| {scale:.4g}  {'ok' if good else 'BAD'}", flush=True)
        used = sum(SHAPE.group_sizes)
        tail = float(jnp.max(jnp.abs(got[0][used:].astype(jnp.float32))))
        print(f"rows past the last group: max|out| {tail}", flush=True)
        ok &= tail == 0.0
    except Exception:  # noqa: BLE001 - the lead wants the whole error text
        traceback.print_exc()
        ok = False
    print("OK" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
