#!/usr/bin/env python
"""How fast can a layer loop read its weights from pinned host memory, and does the copy run under the matmuls?
A probe of the fetch forms `jaxft.memory.scan_offload` could use, on one GPU, outside jaxft's model code.

    PYTHONPATH=. python -m experiments.probes.stream_fetch_probe [--layers 16] [--tokens 16384] --out probe.json

The loop: `--layers` layers of Llama-3.1-8B's matmul shapes (q, k, v, o 4096 x 4096 in the real model's GQA
shapes, gate/up 4096 x 14336, down 14336 x 4096; bf16), forward only, one row of `--tokens` tokens; the layer's
weights are one packed [total] row of an [L, total] stack (`jaxft.memory.streamed`'s layout). Layer i + 1's row is
fetched while layer i runs (as `offloaded_scan` does). Forms:

    device        the stack on the device, sliced in the scan: the compute alone
    copy_only     the stack in pinned host memory, each row fetched, almost no compute: the link alone
    host_iota     pinned host stack, the row's index read from a scanned jnp.arange (offloaded_scan before this probe)
    host_const    the index from a scanned numpy constant (XLA sinks it into the loop: a function of the counter)
    host_counter  the index from a counter in the scan's carry
    host_unrolled one pinned host array per layer, a Python loop: each fetch a whole-array copy (copy-start/done)
    host_xs       the scan slices the pinned host stack itself (row i at iteration i, no prefetch)
    host_xs_shift the scan slices stack[1:] (row i + 1 at iteration i, carried to the next): the prefetch through
                  the scan's own slicing, the last layer after the loop (stack[1:] itself is a copy XLA makes on the host)
    host_peel     L - 1 iterations, each fetching row i + 1 at an index affine in a counter the scan carries (never
                  out of range: no clamp), the last layer after the loop

Compiled for an H200 (experiments/deviceless/hlo_schedule.py `host_slice_forms`): the fetch of host_iota, host_const and
host_counter is a loop fusion (a kernel reading host memory); host_xs, host_xs_shift and host_peel's is a memcpy
(XLA's dynamic slice config: XLA makes one where the offset is an affine function of the loop's induction variable,
or of a counter it merges with it, over every iteration; the clamp min(i + 1, L - 1) and a scanned index array are
neither).

Measured on the H200 (docs/benchmarks.md section 38): host_peel 265 ms a step with XLA's command buffers, 157 without
them (XLA_FLAGS=--xla_gpu_enable_command_buffer=), against 147 for device and 140 for copy_only; host_iota 284 either
way. So a fetch hides under the layer's matmuls when it is a copy and the program has no command buffers.

Per form: the median step time of `--reps` runs after a warm-up (each waited for), and how XLA compiled the fetch
(async dynamic-slice fusions and copy-starts reading host memory, counted in the optimized HLO). A form whose
fetches run under compute takes about max(compute, link); serialised, about their sum.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tests.hlo_text import host_slice_counts  # noqa: E402  (plain text parsing)

H, KV, I = 4096, 1024, 14336  # --small divides each by 16 (a CPU smoke run)


def shapes():
    return (("q", H, H), ("k", H, KV), ("v", H, KV), ("o", H, H), ("g", H, I), ("u", H, I), ("d", I, H))


def total() -> int:
    return sum(a * b for _, a, b in shapes())
FORMS = ("device", "copy_only", "host_iota", "host_const", "host_counter", "host_unrolled", "host_xs", "host_xs_shift",
         "host_peel")


def unpack(row):
    w, at = {}, 0
    for name, a, b in shapes():
        w[name], at = row[at:at + a * b].reshape(a, b), at + a * b
    return w


def layer(x, row):
    """A stand-in with the layer's matmul FLOPs: 2 T (4 H^2 + ... ) per weight read; attention is left out."""
    w = unpack(row)
    q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
    a = q + jnp.tile(k * v, (1, H // KV))
    x = x + (a @ w["o"]) * 0.01
    h = jax.nn.silu(x @ w["g"]) * (x @ w["u"])
    return x + (h @ w["d"]) * 0.01


def to_device(v):
    return jax.device_put(v, jax.memory.Space.Device)


def build(form: str, n: int):
    def fetch(stack, i):
        return to_device(jax.lax.dynamic_index_in_dim(stack, i, keepdims=False))

    if form == "device":
        def run(x, stack):
            def body(c, row):
                return layer(c, row), None
            return jax.lax.scan(body, x, stack)[0]
    elif form == "copy_only":
        def run(x, stack):
            def body(c, i):
                row = fetch(stack, jnp.minimum(i + 1, n - 1))
                return c + jnp.max(row).astype(c.dtype) * 0, None  # reads the whole row (a slice would not)
            return jax.lax.scan(body, x, jnp.arange(n, dtype=jnp.int32))[0]
    elif form in ("host_iota", "host_const"):
        def run(x, stack):
            index = jnp.arange(n, dtype=jnp.int32) if form == "host_iota" else np.arange(n, dtype=np.int32)

            def body(state, i):
                c, w = state
                w_next = fetch(stack, jnp.minimum(i + 1, n - 1))
                return (layer(c, w), w_next), None
            return jax.lax.scan(body, (x, fetch(stack, 0)), index)[0][0]
    elif form == "host_counter":
        def run(x, stack):
            def body(state, _):
                c, w, i = state
                w_next = fetch(stack, jnp.minimum(i + 1, n - 1))
                return (layer(c, w), w_next, i + 1), None
            return jax.lax.scan(body, (x, fetch(stack, 0), jnp.int32(0)), None, length=n)[0][0]
    elif form == "host_xs":
        def run(x, stack):
            return jax.lax.scan(lambda c, row: (layer(c, to_device(row)), None), x, stack)[0]
    elif form == "host_xs_shift":
        def run(x, stack):
            def body(state, row):
                c, w = state
                return (layer(c, w), to_device(row)), None
            (c, w), _ = jax.lax.scan(body, (x, fetch(stack, 0)), stack[1:])
            return layer(c, w)
    elif form == "host_peel":
        def run(x, stack):
            def body(state, _):
                c, w, i = state
                return (layer(c, w), fetch(stack, i + 1), i + 1), None
            (c, w, _), _ = jax.lax.scan(body, (x, fetch(stack, 0), jnp.int32(0)), None, length=n - 1)
            return layer(c, w)
    elif form == "host_unrolled":
        def run(x, rows):
            w = to_device(rows[0])
            for i in range(n):
                w_next = to_device(rows[i + 1]) if i + 1 < n else None
                x = layer(x, w)
                w = w_next
            return x
    else:
        raise SystemExit(f"--forms: unknown form {form!r}; one of {', '.join(FORMS)}")
    return jax.jit(run)


def probe(form: str, n: int, tokens: int, reps: int) -> dict:
    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    rng = np.random.default_rng(0)
    stack = np.full((n, total()), 0.01, dtype=jnp.bfloat16)  # the values do not matter to the timing
    if form == "host_unrolled":
        weights = [jax.device_put(stack[i], host) for i in range(n)]
    else:
        weights = jax.device_put(stack, device if form == "device" else host)
    del stack
    x = jax.device_put(jnp.asarray(rng.standard_normal((tokens, H), np.float32) * 0.1, jnp.bfloat16), device)
    fn = build(form, n)
    t0 = time.perf_counter()
    compiled = fn.lower(x, weights).compile()
    compile_s = time.perf_counter() - t0
    hlo = compiled.as_text()
    copies, kernels = host_slice_counts(hlo)
    jax.block_until_ready(compiled(x, weights))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(x, weights))
        times.append(time.perf_counter() - t0)
    row_bytes = total() * 2
    step = sorted(times)[len(times) // 2]
    return dict(form=form, layers=n, tokens=tokens, step_ms=round(1e3 * step, 2), compile_s=round(compile_s, 1),
                fetched_gb=round(n * row_bytes / 1e9, 3), link_gb_per_s=round(n * row_bytes / 1e9 / step, 1),
                async_dynamic_slices=hlo.count("dynamic-slice-start"), copy_starts=hlo.count("copy-start("),
                host_slices_memcpy=copies, host_slices_kernel=kernels,
                host_values=hlo.count(":S(5)"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--small", action="store_true", help="every width / 16: a smoke run on any device")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.small:
        global H, KV, I
        H, KV, I = H // 16, KV // 16, I // 16
    recs = []
    for form in [f.strip() for f in args.forms.split(",") if f.strip()]:
        try:
            rec = probe(form, args.layers, args.tokens, args.reps)
        except Exception as e:  # a form that does not compile or run is a result too
            rec = dict(form=form, error=f"{type(e).__name__}: {str(e)[:600]}")
        recs.append(rec)
        print(json.dumps(rec), flush=True)
        with open(args.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), jax=jax.__version__, forms=recs), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
