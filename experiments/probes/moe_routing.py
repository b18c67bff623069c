"""The MoE blocks' row movement, timed alone: dispatch + gather to expert order + weighted combine, forward and
backward, as jaxft runs it (`jaxft.models.moe`: gathers both ways, a token's k picks summed as k gathers added
elementwise) against two other forms of the same sums: gathers with a reduction over the middle axis of the
gathered [N, k, H] rows (jaxft's form until section 27 of docs/benchmarks.md), and the plain definition (a gather
whose autodiff is a scatter-add, and a scatter-add combine). The experts are left out (an elementwise stand-in),
so the difference is the routing alone; `dispatch_only` is the sort, the inverse permutation and the group sizes.

    python3 -m experiments.probes.moe_routing [--out moe_routing.json] [--small]

Shapes: the benchmark's 1 x 4096 rows of Qwen3-30B-A3B (H 2048, E 128, k 8) and GPT-OSS-20B (H 2880, E 32,
k 4) (--small: one small shape, a CPU check); bf16; median ms of 20 calls (kernels_pallas._bench.median_ms,
synchronised). Each form's largest difference from jaxft's (output and both gradients, over max |jaxft's|) is
recorded: the forms compute the same sums, so it is bf16 rounding at most.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxft.models.moe import combine, dispatch, gather_tokens, unsort_rows
from kernels_pallas._bench import median_ms

SHAPES = {"qwen3_30b_a3b": (4096, 8, 2048, 128), "gpt_oss_20b": (4096, 4, 2880, 32)}
SMALL = {"small": (256, 8, 64, 16)}


def jaxft_form(xf, weights, experts, num_experts):
    r = dispatch(experts, num_experts)
    xs = gather_tokens(xf, r.token, r.inverse, experts.shape[-1])
    return combine(jax.nn.silu(xs), weights, r, xf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather_reduce(xf, token, inverse, k):
    return xf[token]


def _gather_reduce_fwd(xf, token, inverse, k):
    return xf[token], inverse


def _gather_reduce_bwd(k, inverse, g):
    dxf = jnp.sum(g[inverse].reshape(-1, k, g.shape[-1]).astype(jnp.float32), axis=1)
    return dxf.astype(g.dtype), None, None


_gather_reduce.defvjp(_gather_reduce_fwd, _gather_reduce_bwd)


def reduce_over_k(xf, weights, experts, num_experts):
    """Gathers both ways, the sums over k as a reduction over the middle axis of [N, k, H]."""
    r = dispatch(experts, num_experts)
    n, k = weights.shape
    rows = unsort_rows(jax.nn.silu(_gather_reduce(xf, r.token, r.inverse, k)), r.inverse, r.order).reshape(n, k, -1)
    return jnp.sum(rows.astype(jnp.float32) * weights.astype(jnp.float32)[..., None], axis=1).astype(xf.dtype)


def scatter_add(xf, weights, experts, num_experts):
    """The definition: x[token] (autodiff: a scatter-add back) and a scatter-add of the weighted rows."""
    r = dispatch(experts, num_experts)
    ys = (jax.nn.silu(xf[r.token]) * weights.reshape(-1)[r.order][:, None]).astype(xf.dtype)
    return jnp.zeros_like(xf).at[r.token].add(ys)


def dispatch_only(xf, weights, experts, num_experts):
    r = dispatch(experts, num_experts)
    n = xf.shape[0]
    used = (r.inverse[:n, None] + r.token[:n, None] + r.group_sizes[0]).astype(xf.dtype)
    return xf + used * weights[:, :1].astype(xf.dtype)


FORMS = {"jaxft": jaxft_form, "reduce_over_k": reduce_over_k, "scatter_add": scatter_add,
         "dispatch_only": dispatch_only}


def time_forms(n, k, h, e, iters=20) -> dict:
    rng = np.random.default_rng(0)
    xf = jnp.asarray(rng.standard_normal((n, h)), jnp.bfloat16)
    experts = jnp.asarray(np.argsort(rng.random((n, e)), axis=-1)[:, :k], jnp.int32)
    weights = jnp.asarray(rng.random((n, k)), jnp.float32)
    out, reference = {}, None
    for name, fn in FORMS.items():
        fwd = jax.jit(lambda x, w, f=fn: f(x, w, experts, e))
        grad = jax.jit(jax.grad(lambda x, w, f=fn: jnp.sum(f(x, w, experts, e).astype(jnp.float32) ** 2),
                                argnums=(0, 1)))
        out[name] = dict(fwd_ms=median_ms(fwd, (xf, weights), iters), fwd_bwd_ms=median_ms(grad, (xf, weights), iters))
        if name == "dispatch_only":
            continue
        got = jax.tree.leaves((fwd(xf, weights), grad(xf, weights)))
        reference = reference or got
        f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
        out[name]["max_rel_diff"] = max(float(jnp.max(jnp.abs(f32(a) - f32(b))) / jnp.max(jnp.abs(f32(b))))
                                        for a, b in zip(got, reference))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--small", action="store_true", help="one small shape (a CPU check of the forms)")
    args = p.parse_args(argv)
    result = {name: dict(shape=dict(tokens=n, k=k, hidden=h, experts=e), **time_forms(n, k, h, e))
              for name, (n, k, h, e) in (SMALL if args.small else SHAPES).items()}
    result["device"] = str(jax.devices()[0])
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
