"""The Qwen2-VL / Qwen2.5-VL vision tower on the GPU: with attention "auto" (the kernels the dispatch picks for
bidirectional packed segments: frames, and 2.5-VL's windows) its bf16 output and patch-embedding gradient match
the fp32 reference attention, for head_dim 64 (a Pallas tile size) and 80 (the released towers' head_dim)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxft.models.vision import VisionConfig, VisionTower
from gpu_helpers import compile_fast
from lora_helpers import rel_err

pytestmark = pytest.mark.gpu

# Three images of different sizes, ~1.9k patches: several attention blocks per segment, partial windows. Two
# blocks: 2.5-VL's first is windowed, its second (fullatt_block_indexes) full.
GRIDS = np.asarray([(1, 28, 40), (1, 16, 16), (1, 12, 20)], np.int32)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_tower_kernels_match_reference(kind, head_dim):
    heads = 4
    cfg = VisionConfig(kind=kind, depth=2, embed_dim=heads * head_dim, num_heads=heads, mlp_dim=2 * heads * head_dim,
                       out_hidden_size=256, hidden_act="quick_gelu" if kind == "qwen2_vl" else "silu",
                       patch_size=14, window_size=112 if kind == "qwen2_5_vl" else 0,
                       fullatt_block_indexes=(1,) if kind == "qwen2_5_vl" else ())
    n = int(GRIDS.prod(axis=1).sum())
    pixels = jnp.asarray(np.random.default_rng(0).normal(0, 1, (n, cfg.patch_dim)), jnp.float32)

    def run(dtype, implementation):
        """The tower's output and patch-embedding gradient, compiled without GEMM autotuning (gpu_helpers)."""
        graphdef, state = nnx.split(VisionTower(cfg, dtype=dtype, rngs=nnx.Rngs(0)))

        def loss(state, pixels):
            out = nnx.merge(graphdef, state)(pixels, jnp.asarray(GRIDS), implementation=implementation)
            return jnp.sum(out.astype(jnp.float32) ** 2), out

        def out_and_grad(state, pixels):
            (_, out), grads = jax.value_and_grad(loss, has_aux=True)(state, pixels)
            return out.astype(jnp.float32), grads["patch_embed"]["kernel"][...].astype(jnp.float32)
        return compile_fast(out_and_grad, state, pixels)(state, pixels)

    want, want_grad = run(jnp.float32, "reference")
    got, got_grad = run(jnp.bfloat16, "auto")
    assert rel_err(got, want) < 3e-2
    assert rel_err(got_grad, want_grad) < 5e-2
