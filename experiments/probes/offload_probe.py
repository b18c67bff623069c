"""Probe of host-offloaded rematerialisation: is the offload in the compiled program, and does it lower memory?

Each variant is compiled (and run for a few real steps) in its own subprocess, so the allocator's peak
(`device.memory_stats()["peak_bytes_in_use"]`) belongs to that variant alone. One JSON line per variant:

    model      "jaxft": the recipe's program - `Decoder` + `apply_lora` + `split_model` +
               `loss_and_grad_sums` under an `ExecutionConfig` (4 layers of Llama-3.2-1B widths, 1 x 2048 on a
               GPU; a small shape on the CPU), or "mini": pure JAX, L residual MLP layers, each one
               `jax.checkpoint` that names its input "layer_input" (no jaxft code at all).
    policy     none | full | offload (layer inputs to pinned host by jax.checkpoint's offload policy) |
               offload_explicit (the same through `jaxft.memory.offload.host_offloaded`); loop: scan | unroll
    attention  jaxft only: cudnn (segment ids given: cuDNN's ragged THD path, what tests/test_remat_gpu.py
               compiles), cudnn_dense (no segment ids: jax.nn.dot_product_attention), reference, pallas
    flags      compiler options for this program only (`jit(...).lower().compile(compiler_options=...)`)

Fields: `lowered_placements` - `annotate_device_placement` custom calls in the lowered StableHLO (what JAX asks
for; on the CPU the variant is also lowered for CUDA to count them, since JAX lowers no placement there);
`host_values` - instructions of the compiled HLO whose result type holds a memory-space-5 (host) array
(`...{...:S(5)}`), with `host_ops` its split by opcode (copy-start/copy-done, dynamic-update-slice,
dynamic-slice, ...), and `host_bytes` the bytes of the distinct S(5) arrays they produce; `unlowered_annotations`
- MoveToHost/MoveToDevice/annotate_device_placement custom calls still in the compiled HLO (XLA did not
process them); memory_analysis fields in bytes (temp, argument, output, alias, host_temp, peak); `largest` -
the 4 largest arrays any compiled instruction produces (what dominates temp: e.g. a cuDNN workspace u8[...]);
`peak_bytes`, `live_bytes_before` - allocator peak over the steps and bytes in use before them (None on
the CPU, whose client keeps no stats); `loss`, `grad_norm` - of the first step (equal across policies).

    PYTHONPATH=. python -m experiments.probes.offload_probe [--out probe.jsonl] [--only SUBSTR,...] [--jobs N]

On the CPU it checks itself (exit status 1 on a failed check): gradients of every policy equal to `full`,
placements lowered for CUDA exactly for the offloading policies, full's temp below none's. On the GPU it
prints a verdict per (model, loop, attention): copies kept or dropped, temp and peak of offload vs full/none.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Candidate XLA option (present in jaxlib 0.11.2's DebugOptions, off by default): the collective pipeliner moving a
# scan's host write-back / reload one iteration over. (xla_gpu_enable_host_memory_offloading, also present, is
# XLA's own remat-to-host in HloRematerialization, not the placement of JAX's annotations: left out.)
FLAG_SETS = {
    "": {},
    "pipelined": {"xla_gpu_enable_pipelined_host_offloading": True},
}


def variants(gpu: bool) -> list[dict]:
    """On a GPU: both loops x {mini, recipe with dense cuDNN} x every policy, cuDNN's ragged (THD) path with
    none/full only (its workspace does not depend on the policy), and the candidate option on the offloads."""
    out = []
    policies = ("none", "full", "offload", "offload_explicit")
    for loop in ("scan", "unroll"):
        out += [dict(model="mini", policy=p, loop=loop, flags="") for p in policies]
        # jaxft's explicit transfer is unrolled only (ExecutionConfig rejects it in the scan: XLA cannot place its
        # stacked host copies); the mini program keeps both loops to show that.
        recipe = [p for p in policies if not (loop == "scan" and p == "offload_explicit")]
        if gpu:
            out += [dict(model="jaxft", policy=p, loop=loop, attention="cudnn_dense", flags="") for p in recipe]
            out += [dict(model="jaxft", policy=p, loop=loop, attention="cudnn", flags="") for p in ("none", "full")]
            for model, attention in (("mini", None), ("jaxft", "cudnn_dense")):
                for p in ("offload", "offload_explicit") if model == "mini" else [p for p in recipe if "offload" in p]:
                    v = dict(model=model, policy=p, loop=loop, flags="pipelined")
                    out.append(v if attention is None else dict(v, attention=attention))
        else:
            out += [dict(model="jaxft", policy=p, loop=loop, attention="reference", flags="") for p in recipe]
    return out


def name(v: dict) -> str:
    return "/".join(str(v[k]) for k in ("model", "policy", "loop", "attention", "flags") if v.get(k, "") != "")


# ------------------------------------------------------------------------------------------- HLO counting
_ARRAY = re.compile(r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8e4m3fn|f8e5m2|bf16|f16|f32|f64|c64|c128)"
                    r"\[([\d,]*)\](\{[^}]*\})?")
_BYTES = {"pred": 1, "s4": 1, "s8": 1, "u4": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2,
          "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


def _result_and_opcode(line: str):
    """(result type text, opcode) of an HLO instruction line `%x = TYPE opcode(...)`, else None."""
    _, eq, rhs = line.partition(" = ")
    if not eq:
        return None
    m = re.search(r"\s([a-z][\w-]*)\(", rhs)
    if m is None:
        return None
    return rhs[:m.start()], m.group(1)


def _arrays(type_text: str):
    for m in _ARRAY.finditer(type_text):
        dims = [int(d) for d in m.group(2).split(",") if d]
        n = 1
        for d in dims:
            n *= d
        yield m.group(0), n * _BYTES[m.group(1)], ":S(5)" in (m.group(3) or "")


def hlo_census(text: str) -> dict:
    """Host (memory space 5) values by opcode, their distinct bytes, unprocessed annotations, largest arrays."""
    ops, host_arrays, largest = collections.Counter(), {}, []
    unlowered = 0
    for line in text.splitlines():
        if re.search(r'custom_call_target="(MoveToHost|MoveToDevice|annotate_device_placement)"', line):
            unlowered += 1
        parsed = _result_and_opcode(line)
        if parsed is None:
            continue
        type_text, opcode = parsed
        name_ = line.split(" = ")[0].strip().lstrip("ROOT ").strip()
        arrays = list(_arrays(type_text))
        if any(host for _, _, host in arrays):
            ops[opcode] += 1
            for spelled, size, host in arrays:
                if host:
                    host_arrays[name_ + spelled] = size
        if opcode not in ("parameter", "get-tuple-element", "bitcast", "tuple"):
            for spelled, size, _ in arrays:
                largest.append((size, f"{opcode} {name_}: {spelled}"))
    largest.sort(reverse=True)
    seen, top = set(), []
    for size, what in largest:
        if what not in seen:
            seen.add(what)
            top.append([size, what])
        if len(top) == 4:
            break
    # copy-start results hold the source and the destination: the host bytes are the S(5) arrays only.
    return dict(host_values=sum(ops.values()), host_ops=dict(ops), host_bytes=sum(host_arrays.values()),
                unlowered_annotations=unlowered, largest=top)


def placements(lowered_text: str) -> int:
    return lowered_text.count("annotate_device_placement")


# ------------------------------------------------------------------------------------------- the programs
def _jaxft_program(v: dict, gpu: bool):
    """(jitted fn, real args, abstract args) of the recipe's gradient step for variant v."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxft.config import ModelConfig
    from jaxft.memory.execution import ExecutionConfig
    from jaxft.lora import LoraConfig, apply_lora
    from jaxft.models import init_model
    from jaxft.models.layers import linears
    from jaxft.train.step import loss_and_grad_sums, split_model, unstack_layers

    if gpu:
        cfg = ModelConfig(model_type="llama", vocab_size=8192, hidden_size=2048, intermediate_size=8192,
                          num_layers=4, num_heads=32, num_kv_heads=8, head_dim=64)
        t, dtype = 2048, jnp.bfloat16
    else:
        cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
                          num_heads=4, num_kv_heads=2, head_dim=16)
        t, dtype = 256, jnp.float32
    model = apply_lora(init_model(cfg, dtype=dtype, seed=0), LoraConfig(r=16, alpha=32), seed=1)
    rng = np.random.default_rng(1)
    for _, lin in linears(model):  # B = 0 would make every A gradient zero
        if lin.has_lora:
            lin.lora_b[...] = jnp.asarray(rng.normal(0, 0.05, lin.lora_b.shape), lin.lora_b.dtype)
    graphdef, lora, frozen = split_model(model)
    frozen = unstack_layers(frozen) if v["loop"] == "unroll" else frozen
    ids = rng.integers(0, cfg.vocab_size, (1, 1, t)).astype(np.int32)
    batch = dict(input_ids=ids, targets=np.roll(ids, -1, -1), loss_mask=np.ones((1, 1, t), np.float32),
                 positions=np.arange(t, dtype=np.int32)[None, None])
    attention = v.get("attention", "reference")
    # cudnn_dense: no segment ids, so cuDNN runs jax.nn.dot_product_attention; otherwise one segment per row.
    batch["segment_ids"] = None if attention == "cudnn_dense" else np.ones((1, 1, t), np.int32)
    remat = {"offload_explicit": "offload", "none": "none", "full": "full", "offload": "offload"}[v["policy"]]
    # "offload" is jax.checkpoint's policy in both loops (what the H200 measured), "offload_explicit"
    # jaxft.memory.offload.
    extra = {"offload_transfer": "explicit" if v["policy"] == "offload_explicit" else "policy"}
    ex = ExecutionConfig(attention_implementation="cudnn" if attention.startswith("cudnn") else attention,
                         remat=remat, layer_loop=v["loop"], **extra)
    fn = jax.jit(lambda lo, fz, b: loss_and_grad_sums(graphdef, lo, fz, b, None, ex)[:2])
    return fn, (lora, frozen, batch)


def _mini_program(v: dict, gpu: bool):
    """L residual MLP layers x + W2 tanh(W1 norm(x)), each checkpointed, naming its input "layer_input"."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.ad_checkpoint import checkpoint_name

    layers, t, h, f = (8, 8192, 2048, 8192) if gpu else (4, 128, 32, 64)
    dtype = jnp.bfloat16 if gpu else jnp.float32
    rng = np.random.default_rng(0)
    w1 = jnp.asarray(rng.normal(0, h ** -0.5, (layers, h, f)), dtype)
    w2 = jnp.asarray(rng.normal(0, f ** -0.5, (layers, f, h)), dtype)
    x0 = jnp.asarray(rng.normal(0, 1, (t, h)), dtype)

    def layer(x, w):
        x = checkpoint_name(x, "layer_input")
        a, b = w
        n = x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6).astype(x.dtype)
        return x + jnp.tanh(n @ a) @ b

    if v["policy"] == "none":
        body = layer
    elif v["policy"] == "full":
        body = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
    elif v["policy"] == "offload":
        pol = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=["layer_input"], offload_src="device",
            offload_dst="pinned_host")
        body = jax.checkpoint(layer, policy=pol)
    else:
        from jaxft.memory.offload import host_offloaded

        body = host_offloaded(layer)

    def loss(ws, x):
        if v["loop"] == "scan":
            x, _ = jax.lax.scan(lambda c, w: (body(c, w), None), x, ws)
        else:
            for i in range(layers):
                x = body(x, (ws[0][i], ws[1][i]))
        return jnp.mean(jnp.square(x.astype(jnp.float32)))

    fn = jax.jit(jax.value_and_grad(loss))
    return fn, ((w1, w2), x0)


def run_variant(v: dict, steps: int) -> dict:
    import jax
    import numpy as np

    gpu = jax.default_backend() == "gpu"
    rec = dict(name=name(v), **v, backend=jax.default_backend())
    t0 = time.perf_counter()
    fn, args = (_jaxft_program if v["model"] == "jaxft" else _mini_program)(v, gpu)
    jax.block_until_ready(jax.tree.leaves(args))
    lowered = fn.lower(*args)
    rec["lowered_placements"] = placements(lowered.as_text())
    if not gpu:  # JAX lowers no placement for the CPU: count what the CUDA lowering asks for
        try:
            rec["lowered_placements_cuda"] = placements(
                fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text())
        except Exception as e:  # noqa: BLE001 (a probe reports, it does not stop)
            rec["lowered_placements_cuda"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    options = dict(FLAG_SETS[v.get("flags", "")])
    if v.get("dump"):  # XLA's HLO before/after optimisation, the host-offload passes and the buffer assignment
        options.update(xla_dump_to=os.path.join(v["dump"], name(v).replace("/", "_")), xla_dump_hlo_as_text=True,
                       xla_dump_hlo_pass_re="host|memory-space|memory_space")
    try:
        compiled = lowered.compile(compiler_options=options or None)
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"compile: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return rec
    rec["compile_s"] = round(time.perf_counter() - t0, 2)
    ma = compiled.memory_analysis()
    for key in ("temp", "argument", "output", "alias", "host_temp", "host_argument", "host_output"):
        rec[key] = getattr(ma, f"{key}_size_in_bytes", None)
    rec["peak_estimate"] = getattr(ma, "peak_memory_in_bytes", None)
    rec.update(hlo_census(compiled.as_text()))
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    rec["live_bytes_before"] = stats.get("bytes_in_use")
    budget = stats.get("bytes_limit")
    need = (rec["temp"] or 0) + (rec["argument"] or 0) + (rec["output"] or 0)
    if budget is not None and need > 0.95 * budget:
        rec["run"] = f"skipped: estimate {need / 2**30:.1f} GiB > this worker's limit {budget / 2**30:.1f} GiB"
        rec["needs_exclusive"] = True
        return rec
    for i in range(steps):
        out = compiled(*args)
        jax.block_until_ready(out)
        if i == 0:
            loss, grads = out
            rec["loss"] = float(loss)
            rec["grad_norm"] = float(np.sqrt(sum(float(np.sum(np.square(np.asarray(g, np.float64))))
                                               for g in jax.tree.leaves(grads))))
            if not gpu:
                rec["_grads"] = [np.asarray(g, np.float64).ravel().tolist() for g in jax.tree.leaves(grads)]
    rec["peak_bytes"] = (dev.memory_stats() or {}).get("peak_bytes_in_use")
    rec["run_s"] = round(time.perf_counter() - t0, 2)
    return rec


# ------------------------------------------------------------------------------------------- driver
def _spawn(v: dict, steps: int, mem_fraction: float | None) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if mem_fraction is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{mem_fraction:.2f}"
    cmd = [sys.executable, "-m", "experiments.probes.offload_probe", "--worker", json.dumps(v), "--steps", str(steps)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return dict(name=name(v), **v, error=f"worker rc={p.returncode}: {(p.stderr or p.stdout)[-600:]}")


def _gpu_backend() -> bool:
    p = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True,
                       text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    return p.stdout.strip().endswith("gpu")


def check_cpu(recs: list[dict]) -> list[str]:
    """The CPU's self-checks (empty: all passed)."""
    import numpy as np

    bad = []
    by = {r["name"]: r for r in recs}
    for r in recs:
        if "error" in r:
            bad.append(f"{r['name']}: {r['error']}")
            continue
        offloads = r["policy"].startswith("offload")
        cuda = r.get("lowered_placements_cuda")
        if isinstance(cuda, int) and (cuda > 0) != offloads:
            bad.append(f"{r['name']}: {cuda} placements lowered for CUDA (offloading policy: {offloads})")
        full = by.get(r["name"].replace(f"/{r['policy']}/", "/full/"))
        if full and r is not full and "_grads" in r and "_grads" in full:
            # 2e-6 of each gradient's largest entry (tests/test_remat.py: XLA fuses the programs differently);
            # no remat too, whose gradients are the same math without any recompute.
            for a, b in zip(r["_grads"], full["_grads"]):
                err, scale = float(np.max(np.abs(np.subtract(a, b)))), float(np.max(np.abs(b)))
                if err > 2e-6 * scale:
                    bad.append(f"{r['name']}: gradient differs from full by {err:.2e} (largest entry {scale:.2e})")
                    break
        none = by.get(r["name"].replace(f"/{r['policy']}/", "/none/"))
        if r["policy"] == "full" and none and not r["temp"] < none["temp"]:
            bad.append(f"{r['name']}: temp {r['temp']} not below none's {none['temp']}")
    return bad


def verdicts(recs: list[dict]) -> list[str]:
    """One line per (model, loop, attention, flags) offloading variant: copies kept?, temp/peak vs full and none."""
    by = {r["name"]: r for r in recs}
    lines = []
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    for r in recs:
        if not r["policy"].startswith("offload") or "error" in r:
            continue
        base = r["name"].replace(f"/{r['policy']}/", "/{}/")
        if r.get("flags"):
            base = base.rsplit("/", 1)[0]
        full, none = by.get(base.format("full"), {}), by.get(base.format("none"), {})
        lines.append(f"{r['name']}: host values {r['host_values']} ({gib(r['host_bytes'])} GiB on host), "
                     f"temp {gib(r['temp'])} vs full {gib(full.get('temp'))} / none {gib(none.get('temp'))} GiB; "
                     f"peak {gib(r.get('peak_bytes'))} vs full {gib(full.get('peak_bytes'))} / none "
                     f"{gib(none.get('peak_bytes'))} GiB")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", help="also write the JSON lines here")
    ap.add_argument("--only", help="comma-separated substrings of variant names to keep")
    ap.add_argument("--skip", help="comma-separated substrings of variant names to leave out")
    ap.add_argument("--dump", help="DIR: dump XLA's HLO of the variants named by --dump-only into DIR")
    ap.add_argument("--dump-only", default="offload/", help="substrings of the variants to dump (with --dump)")
    ap.add_argument("--jobs", type=int, default=None, help="variants at once (default: 3 on a GPU, 1 on the CPU)")
    args = ap.parse_args(argv)
    if args.worker:
        rec = run_variant(json.loads(args.worker), args.steps)
        print(json.dumps(rec), flush=True)
        return 0
    t0 = time.perf_counter()
    gpu = _gpu_backend()
    todo = variants(gpu)
    if args.only:
        keys = args.only.split(",")
        todo = [v for v in todo if any(k in name(v) for k in keys)]
    if args.skip:
        keys = args.skip.split(",")
        todo = [v for v in todo if not any(k in name(v) for k in keys)]
    if args.dump:
        for v in todo:
            if any(k in name(v) for k in args.dump_only.split(",")):
                v["dump"] = os.path.abspath(args.dump)
    jobs = args.jobs or (4 if gpu else 1)
    fraction = 0.9 / jobs if gpu else None
    recs = []
    out = open(args.out, "w") if args.out else None

    def emit(rec):
        printable = {k: v for k, v in rec.items() if not k.startswith("_")}
        print(json.dumps(printable), flush=True)
        if out:
            out.write(json.dumps(printable) + "\n")
            out.flush()
        recs.append(rec)

    exclusive = []
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for rec in pool.map(lambda v: _spawn(v, args.steps, fraction), todo):
            if rec.get("needs_exclusive"):
                exclusive.append({k: rec[k] for k in ("model", "policy", "loop", "attention", "flags", "dump")
                                  if k in rec})
            else:
                emit(rec)
    for v in exclusive:  # too large to share the device: alone, with most of its memory
        emit(_spawn(v, args.steps, 0.9 if gpu else None))
    print(f"# {len(recs)} variants in {time.perf_counter() - t0:.0f} s on {'gpu' if gpu else 'cpu'}", flush=True)
    for line in verdicts(recs):
        print("# " + line)
    if not gpu:
        bad = check_cpu(recs)
        for line in bad:
            print("# CHECK FAILED: " + line)
        print(f"# CPU self-check: {'FAILED' if bad else 'passed'}")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
