"""The MoE blocks' row movement, timed alone: dispatch + gather to expert order + weighted combine, forward and
backward, as jaxft runs it (`jaxft.models.moe`: gathers both ways) against the plain definition (a gather whose
autodiff is a scatter-add, and `scatter_combine`: what Qwen3-MoE's block runs). The experts are left out
(an elementwise stand-in), so the difference is the routing alone.

    PYTHONPATH=.:scripts python3 scripts/bench/moe_routing.py [--out moe_routing.json]

Shapes: the benchmark's 1 x 4096 rows of Qwen3-30B-A3B (H 2048, E 128, k 8) and GPT-OSS-20B (H 2880, E 32,
k 4); bf16; median ms of 20 calls (kernels_pallas._bench.median_ms, synchronised).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxft.models.moe import combine, dispatch, gather_tokens, scatter_combine
from kernels_pallas._bench import median_ms

SHAPES = {"qwen3_30b_a3b": (4096, 8, 2048, 128), "gpt_oss_20b": (4096, 4, 2880, 32)}


def ours(xf, weights, experts, num_experts):
    r = dispatch(experts, num_experts)
    xs = gather_tokens(xf, r.token, r.inverse, experts.shape[-1])
    return combine(jax.nn.silu(xs), weights, r, xf)


def plain(xf, weights, experts, num_experts):
    r = dispatch(experts, num_experts)
    return scatter_combine(jax.nn.silu(xf[r.token]), weights, r, xf)


def time_both(n, k, h, e, iters=20) -> dict:
    rng = np.random.default_rng(0)
    xf = jnp.asarray(rng.standard_normal((n, h)), jnp.bfloat16)
    experts = jnp.asarray(np.argsort(rng.random((n, e)), axis=-1)[:, :k], jnp.int32)
    weights = jnp.asarray(rng.random((n, k)), jnp.float32)
    out = {}
    for name, fn in (("gathers", ours), ("scatter_add", plain)):
        fwd = jax.jit(lambda x, w, f=fn: f(x, w, experts, e))
        grad = jax.jit(jax.grad(lambda x, w, f=fn: jnp.sum(f(x, w, experts, e).astype(jnp.float32) ** 2),
                                argnums=(0, 1)))
        out[name] = dict(fwd_ms=median_ms(fwd, (xf, weights), iters), fwd_bwd_ms=median_ms(grad, (xf, weights), iters))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = {name: dict(shape=dict(tokens=n, k=k, hidden=h, experts=e), **time_both(n, k, h, e))
              for name, (n, k, h, e) in SHAPES.items()}
    result["device"] = str(jax.devices()[0])
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
