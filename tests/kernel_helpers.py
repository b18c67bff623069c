"""Shared by the kernel tests: an op's output and gradients as one compiled program."""

import jax


def jitted_vjp(fn, dout, *primals):
    """fn's output and its gradients for `dout`, one jitted program (run op by op, every eager op of a new shape
    compiles on its own)."""
    def run(dout, *primals):
        out, pull = jax.vjp(fn, *primals)
        return (out, *pull(dout))
    return jax.jit(run)(dout, *primals)
