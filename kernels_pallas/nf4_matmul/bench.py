"""Benchmark: every implementation of the nf4_matmul op (OP in api.py), forward + input gradient, on the
8B projection shapes at training sizes, next to the same matmul on a dense bf16 weight ("dense_bf16").

    python -m kernels_pallas.nf4_matmul.bench            # BENCH_SHAPES (GPU-sized)
    python -m kernels_pallas.nf4_matmul.bench --smoke    # shapes.TEST_SHAPES[0], CPU ok

The weight is quantised once per shape (NF4, blocks of 64, float32 absmax) and passed to the timed program as
a frozen (not differentiated) argument: only x is differentiated. (A closed-over weight would be a constant
that XLA folds - the whole dequantisation at compile time - and the timing would be of a dense matmul.)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax.numpy as jnp

from kernels_pallas._bench import Timing, bench_main, time_fwd_bwd

from .api import OP
from .shapes import BENCH_SHAPES, TEST_SHAPES, make_inputs


def _quantise(w, blocksize: int):
    # NF4 by nearest code (bitsandbytes' formula; jaxft.quant has the byte-exact version, which this op package
    # must not import): enough to time the op, whose cost does not depend on the code values.
    from .codes import NF4
    flat = w.reshape(-1, blocksize)
    absmax = jnp.max(jnp.abs(flat), axis=1)
    x = flat / absmax[:, None]
    q = jnp.argmin(jnp.abs(x[..., None] - jnp.asarray(NF4)), axis=-1).astype(jnp.uint8).reshape(-1)
    return (q[0::2] << 4) | q[1::2], absmax


def run(shapes=BENCH_SHAPES, implementations: Sequence[str] = OP.names, iters: int = 10) -> list[Timing]:
    rows = []
    for shape in shapes:
        x, w, _ = make_inputs(shape)
        packed, absmax = _quantise(w, shape.blocksize)
        dims = (shape.out_features, shape.in_features)
        dense = w.astype(x.dtype)
        rows.append(time_fwd_bwd("nf4_matmul", shape.name, "dense_bf16",
                                 lambda a, d: jnp.einsum("mi,oi->mo", a, d), (x,), iters=iters, frozen=(dense,)))
        for name in implementations:
            fn = functools.partial(OP.resolve(name).fn, shape=dims, blocksize=shape.blocksize, quant_type="nf4")
            rows.append(time_fwd_bwd("nf4_matmul", shape.name, name,
                                     lambda a, p, m, f=fn: f(a, packed=p, absmax=m), (x,), iters=iters,
                                     frozen=(packed, absmax)))
    return rows


def main(argv: Sequence[str] | None = None) -> list[Timing]:
    return bench_main(__doc__, run, TEST_SHAPES, BENCH_SHAPES, argv)


if __name__ == "__main__":
    main()
