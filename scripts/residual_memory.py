"""Activation memory a LoRA training step keeps for its backward pass, from the traced program (no GPU).

Counts the residuals JAX saves per decoder layer (the layer scan's stacked outputs) for a 2-layer model
with Llama-3.1-8B widths at 1 x 4096 tokens, LoRA r=16 on all linear layers, Pallas attention, and
scales to 32 layers. It is an analysis of the program, not a device measurement (XLA may add workspace).

    PYTHONPATH=. python scripts/residual_memory.py
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals
from jaxft.config import ModelConfig
from jaxft.execution import ExecutionConfig
from jaxft.models import init_model
from jaxft.lora import LoraConfig, apply_lora
from jaxft.train.step import split_model, token_loss_sum
hf = dict(model_type="llama", vocab_size=1024, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072)
cfg = ModelConfig.from_hf(hf)
m = init_model(cfg, dtype=jnp.bfloat16)
m = apply_lora(m, LoraConfig(r=16, alpha=32, target_modules=("q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj")))
g, lora, frozen = split_model(m)
T = 4096
batch = dict(input_ids=jnp.zeros((1,T),jnp.int32), targets=jnp.zeros((1,T),jnp.int32), loss_mask=jnp.ones((1,T)),
             segment_ids=jnp.ones((1,T),jnp.int32), positions=jnp.arange(T)[None])
pallas = ExecutionConfig(attention_implementation="pallas")
res = saved_residuals(lambda l: token_loss_sum(nnx.merge(g, l, frozen), batch, execution=pallas), lora)
per_layer = 0
for aval, src in res:
    if "scan" in src and aval.shape and aval.shape[0] == 2:
        per_layer += int(np.prod(aval.shape[1:])) * aval.dtype.itemsize
print(f"saved activations per layer (8B widths, 1x4096 tokens): {per_layer/2**20:.0f} MiB; x32 layers: {32*per_layer/2**30:.1f} GiB")
