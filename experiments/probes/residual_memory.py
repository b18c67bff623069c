"""Activation memory a LoRA training step keeps for its backward pass, from the traced program (no GPU).

Counts the residuals JAX saves in the layer scan (its stacked outputs) of a model with a bench shape's widths
(`scripts/bench/workloads.py` SHAPES) cut to its first `--layers` layers, at 1 x `--seq` tokens, under a remat
policy, with the bench's LoRA (all linear layers; on an MoE shape the attention linears and the expert weights):
bytes per layer, and the largest residual kinds. An analysis of the program, not a device measurement: XLA may add
workspace, and an MoE shape's experts run on `ragged_dot` here, whose transpose keeps each layer's expert weights
(listed as such; the Mosaic GPU kernels the H200 runs read them in place).

    python -m experiments.probes.residual_memory                                   # Llama-3.1-8B widths, 1 x 4096
    python -m experiments.probes.residual_memory --shape gpt-oss-20b --seq 4096    # GPT-OSS-20B widths, one period
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals


from scripts.bench.workloads import LORA, SHAPES, lora_module_targets, moe_layout  # noqa: E402
from jaxft.config import ModelConfig  # noqa: E402
from jaxft.memory.execution import ExecutionConfig  # noqa: E402
from jaxft.lora import LoraConfig, apply_lora  # noqa: E402
from jaxft.models import init_model  # noqa: E402
from jaxft.train.step import split_model, token_loss_sum  # noqa: E402

MIB = 2**20


def cut_config(shape: str, layers: int) -> ModelConfig:
    """The shape's config with its first `layers` layers and a small vocabulary (the head is not a residual)."""
    hf = dict(SHAPES[shape].config_dict())
    hf["num_hidden_layers"] = layers
    if "layer_types" in hf:
        hf["layer_types"] = hf["layer_types"][:layers]
    hf["vocab_size"] = 1024
    return ModelConfig.from_hf(hf)


def layer_residuals(shape: str, seq: int, remat: str, layers: int) -> tuple[float, list[tuple]]:
    """(bytes the scan keeps per layer, ragged_dot's expert weights left out; [(bytes per layer, dtype, shape of one
    layer's residual, what)] by kind, largest first)."""
    cfg = cut_config(shape, layers)
    moe = moe_layout(SHAPES[shape]) is not None
    lora = LoraConfig(r=LORA.r, alpha=LORA.alpha, target_modules=lora_module_targets(SHAPES[shape]),
                      target_parameters=LORA.expert_targets if moe else None)
    model = apply_lora(init_model(cfg, dtype=jnp.bfloat16), lora)
    graphdef, adapters, frozen = split_model(model)
    batch = dict(input_ids=jnp.zeros((1, seq), jnp.int32), targets=jnp.zeros((1, seq), jnp.int32),
                 loss_mask=jnp.ones((1, seq)), segment_ids=jnp.ones((1, seq), jnp.int32),
                 positions=jnp.arange(seq)[None])
    ex = ExecutionConfig(attention_implementation="pallas", remat=remat, layer_loop="scan",
                         grouped_matmul_implementation="xla" if moe else "auto")
    kept = saved_residuals(lambda lo: token_loss_sum(nnx.merge(graphdef, lo, frozen), batch, execution=ex),
                           adapters)
    expert_weights = {tuple(v.shape[1:]) for p, v in nnx.to_flat_state(frozen) if "proj" in str(p[-1]) and
                      len(v.shape) == 4}
    kinds: collections.Counter = collections.Counter()
    for aval, source in kept:
        if "scan" not in source or not aval.shape:
            continue
        # A stacked residual's leading axis counts the scan's iterations: layers, or whole periods of a periodic
        # stack (one residual per position of the period): either way its bytes over `layers` are per layer.
        what = ("expert weights (ragged_dot only)" if tuple(aval.shape[1:]) in expert_weights
                else source.split(" from ")[0])
        kinds[(str(aval.dtype), tuple(aval.shape[1:]), what)] += int(np.prod(aval.shape)) * aval.dtype.itemsize
    rows = sorted(((b / layers, dt, sh, w) for (dt, sh, w), b in kinds.items()), key=lambda r: -r[0])
    return sum(row[0] for row in rows if not row[3].startswith("expert weights")), rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--remat", default="none")
    ap.add_argument("--layers", type=int, default=2, help="layers traced (whole periods of a periodic stack)")
    args = ap.parse_args()
    total, rows = layer_residuals(args.shape, args.seq, args.remat, args.layers)
    print(f"{args.shape}, 1 x {args.seq}, remat {args.remat}: the layer scan keeps {total / MIB:,.0f} MiB a layer "
          f"(expert weights of ragged_dot left out)")
    print("| MiB a layer | dtype | shape | what |\n|---:|---|---|---|")
    for mib, dtype, shape, what in rows[:12]:
        print(f"| {mib / MIB:,.1f} | {dtype} | {list(shape)} | {what} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
