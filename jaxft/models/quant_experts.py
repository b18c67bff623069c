"""MoE expert stacks in 4 bits (QLoRA on Qwen3-MoE / GPT-OSS: the experts are ~95% of the weights).

An expert stack W [*stack, E, in, out] (`ExpertParam`, our [in, out] layout) is stored as E bitsandbytes
records per layer, each expert quantised as its own torch-layout [out, in] matrix (what
`bitsandbytes.functional.quantize_4bit(W_e.T)` gives, double quantisation included, per expert):

    packed [*stack, E, ceil(out*in/2)] uint8,  absmax [*stack, E, blocks] (uint8 codes with double quantisation,
    else float32),  nested_absmax [*stack, E, nested blocks] float32,  offset [*stack, E] float32

all `QuantizedExpertWeight`s. The MoE block calls `expert_matmul(xs, weight, sizes)` on one layer's slice: for
a `Quant4bitExperts` that is `kernels_pallas.nf4_matmul.nf4_grouped_matmul` (the layer's experts dequantised to
the compute dtype inside its custom VJP, forward and again in the backward; nothing dequantised is saved), for
an `ExpertParam` the plain grouped matmul; either way the grouped matmul is the one `gmm_implementation` names
(`ExecutionConfig.grouped_matmul_implementation`, handed down by the block). `expert_weight` gives the dense stack
(merged exports, LoRA merges).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxft.models.layers import ExpertParam, QuantizedExpertWeight, StackRow, init_4bit_buffers
from jaxft.quant.blockwise import dequantize_absmax
from kernels_pallas import nf4_matmul as nf4_ops
from kernels_pallas.grouped_matmul import grouped_matmul

__all__ = ["Quant4bitExperts", "expert_matmul", "expert_weight"]


class Quant4bitExperts(nnx.Module):
    """A stack of E frozen 4-bit expert weights of width in -> out (see the module docstring).

    `shape` is that of the dense weight it stands for, [*lead, E, in, out], with the lead axes of the arrays it
    holds now (the layer axis outside the layer loop, none on one layer's slice), as `ExpertParam.shape`."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, stack: tuple[int, ...],
                 quant_type: str = "nf4", blocksize: int = 64, double_quant: bool = True, nested_blocksize: int = 256,
                 source_dtype: str = "bfloat16", arrays: dict | None = None):
        # `arrays` ({packed, absmax[, nested_absmax, offset]}, `jaxft.quant.quantize_4bit_batch` per layer,
        # stacked) fills the variables instead of zeros.
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.quant_type, self.blocksize, self.nested_blocksize = quant_type, blocksize, nested_blocksize
        self.source_dtype = source_dtype
        init_4bit_buffers(self, (*stack, num_experts), out_features, in_features, blocksize=blocksize,
                          double_quant=double_quant, nested_blocksize=nested_blocksize, arrays=arrays,
                          var_type=QuantizedExpertWeight,
                          what=f"{num_experts} experts [{out_features}, {in_features}]")

    @property
    def double_quant(self) -> bool:
        return self.nested_absmax is not None

    @property
    def record_shape(self) -> tuple[int, int]:
        """One expert's weight in torch's [out, in] layout (what each record quantises)."""
        return (self.out_features, self.in_features)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.in_features, self.out_features)

    def absmax_f32(self) -> jax.Array:
        """The float32 block absmax [*lead, E, blocks] (de-nested per expert when double-quantised)."""
        absmax = self.absmax[...]
        if not self.double_quant:
            return absmax
        lead = absmax.shape[:-1]
        flat = jax.vmap(lambda q, nested, offset: dequantize_absmax(q, nested, offset, self.nested_blocksize))(
            absmax.reshape(-1, absmax.shape[-1]), self.nested_absmax[...].reshape(-1, self.nested_absmax.shape[-1]),
            self.offset[...].reshape(-1))
        return flat.reshape(*lead, -1)

    def dequantize(self, dtype) -> jax.Array:
        """The dense stack [*lead, E, in, out] in `dtype` (every layer held: for exports and merges, not steps)."""
        packed = self.packed[...]
        lead = packed.shape[:-1]
        w = nf4_ops.dequantize_groups(packed.reshape(-1, packed.shape[-1]),
                                      self.absmax_f32().reshape(-1, self.absmax.shape[-1]), shape=self.record_shape,
                                      blocksize=self.blocksize, quant_type=self.quant_type, dtype=dtype)
        return jnp.swapaxes(w, -1, -2).reshape(*lead, self.in_features, self.out_features)

    def matmul(self, xs: jax.Array, group_sizes: jax.Array, gmm_implementation: str = "auto") -> jax.Array:
        """gmm(xs, W) on ONE layer's experts (the slice the layer loop passes), dequantised in xs's dtype inside
        the op's custom VJP; its grouped matmuls (forward and backward) are `gmm_implementation`'s."""
        if self.packed.ndim != 2:
            raise ValueError(f"Quant4bitExperts.matmul: called on a stack {self.packed.shape[:-1]}; the MoE block "
                             "runs on one layer's experts [E, ...] (inside the layer loop)")
        return nf4_ops.nf4_grouped_matmul(xs, self.packed[...], self.absmax_f32(), group_sizes,
                                          shape=self.record_shape, blocksize=self.blocksize,
                                          quant_type=self.quant_type, gmm_implementation=gmm_implementation)


def expert_matmul(xs: jax.Array, weight, group_sizes: jax.Array, gmm_implementation: str = "auto", *,
                  lora=None, adapter=None) -> jax.Array:
    """out[m] = xs[m] @ W_g(m) for one layer's expert weight: an `ExpertParam` [E, in, out] (cast to xs's dtype)
    or holding a `StackRow` of its stack (in a layer scan), or a `Quant4bitExperts`, by the grouped matmul
    `gmm_implementation` names (`kernels_pallas.grouped_matmul`). With `lora` = (xa [M, r], b [E, r, out])
    (`ExpertLora.sorted_factors`) plus gmm(xa, b); with `adapter` = (a [E, in, r], b [E, r, out])
    (`ExpertLora.grouped_adapter`) plus gmm(gmm(xs, a), b): in the same grouped matmul (`grouped_matmul(...,
    lora= / adapter=)`), or for 4-bit experts as products of their own."""
    gmm = functools.partial(grouped_matmul, implementation=gmm_implementation, lora=lora, adapter=adapter)
    if isinstance(weight, Quant4bitExperts):
        out = weight.matmul(xs, group_sizes, gmm_implementation)
        if adapter is not None:
            lora = (grouped_matmul(xs, adapter[0], group_sizes, implementation=gmm_implementation), adapter[1])
        return out if lora is None else out + grouped_matmul(*lora, group_sizes, implementation=gmm_implementation)
    value = weight.get_value()
    if isinstance(value, StackRow):  # inside a layer scan: the layer's row of the stack, read in place
        if value.dtype != xs.dtype:  # a cast would copy the whole stack: cast the row alone
            return gmm(xs, value.sliced().astype(xs.dtype), group_sizes)
        return gmm(xs, value.stack, group_sizes, row=value.row)
    return gmm(xs, value.astype(xs.dtype), group_sizes)


def expert_weight(weight, dtype=None) -> jax.Array:
    """The dense stack of an expert weight: the `ExpertParam`'s value (cast to `dtype` if given), or the 4-bit
    stack dequantised in `dtype` (default: the dtype it was quantised from)."""
    if isinstance(weight, Quant4bitExperts):
        return weight.dequantize(dtype or jnp.dtype(weight.source_dtype))
    if not isinstance(weight, ExpertParam):
        raise TypeError(f"expert_weight: {type(weight).__name__} is not an expert stack")
    return weight[...] if dtype is None else weight[...].astype(dtype)
