"""GPU check of the foundation: a Llama-3.2-1B-shaped model (random weights) runs its bf16 forward through
every attention implementation and matches the fp32 logits within bf16 tolerance. Prints and writes JSON.

    python -m experiments.probes.gpu_forward_check --out $OUT/forward.json [--seq 4096] [--impls xla,cudnn,pallas]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxft.config import ModelConfig
from jaxft.memory.execution import ExecutionConfig
from jaxft.models import init_model

LLAMA_32_1B = dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                   num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                   max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192})


def _forward_fn(model, attention: str = "reference"):
    graphdef, state = nnx.split(model)
    execution = ExecutionConfig(attention_implementation=attention)

    @jax.jit
    def fwd(state, ids, seg):
        return nnx.merge(graphdef, state)(ids, segment_ids=seg, execution=execution)

    return fwd, state


def _time(fn, *args, reps=10):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--impls", default="xla,cudnn,pallas")
    args = ap.parse_args()
    cfg = ModelConfig.from_hf(LLAMA_32_1B)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, args.seq)), jnp.int32)
    # Two documents per row, so the packed (segment) path is exercised too.
    seg = jnp.asarray(np.repeat(np.array([[1] * (args.seq // 3) + [2] * (args.seq - args.seq // 3)]),
                                args.batch, 0), jnp.int32)
    results = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "seq": args.seq,
               "batch": args.batch, "impls": {}}

    model32 = init_model(cfg, dtype=jnp.float32, seed=0)
    fwd32, state32 = _forward_fn(model32)
    with jax.default_matmul_precision("highest"):  # a true fp32 reference, not TF32
        ref = np.asarray(fwd32(state32, ids, seg).astype(jnp.float32))
    bf16_state = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state32)
    del model32, state32
    scale = float(np.max(np.abs(ref)))
    for impl in args.impls.split(","):
        entry = {}
        try:
            model = init_model(cfg, dtype=jnp.bfloat16, seed=0)
            fwd, _ = _forward_fn(model, impl)
            del model
            out = np.asarray(fwd(bf16_state, ids, seg).astype(jnp.float32))
            err = np.abs(out - ref)
            entry.update(
                max_abs_err=float(err.max()), rel_max_err=float(err.max() / scale),
                mean_abs_err=float(err.mean()), ref_max_abs=scale,
                top1_agreement=float(np.mean(out.argmax(-1) == ref.argmax(-1))),
                ms_per_forward=1e3 * _time(fwd, bf16_state, ids, seg),
            )
            # bf16 has 8 mantissa bits; 16 layers of bf16 rounding keep the logits within a few percent.
            entry["ok"] = bool(entry["rel_max_err"] < 0.05 and entry["top1_agreement"] > 0.9)
        except Exception as e:  # noqa: BLE001 - reported, the other implementations still run
            entry.update(ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}")
        results["impls"][impl] = entry
        print(impl, json.dumps(entry), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
