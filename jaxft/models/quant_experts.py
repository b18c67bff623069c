"""MoE expert stacks in 4 bits or FP8 (Qwen3-MoE / GPT-OSS: the experts are ~95% of the weights).

An expert stack W [*stack, E, in, out] (`ExpertParam`, our [in, out] layout) is stored as E bitsandbytes
records per layer, each expert quantised as its own torch-layout [out, in] matrix (what
`bitsandbytes.functional.quantize_4bit(W_e.T)` gives, double quantisation included, per expert):

    packed [*stack, E, ceil(out*in/2)] uint8,  absmax [*stack, E, blocks] (uint8 codes with double quantisation,
    else float32),  nested_absmax [*stack, E, nested blocks] float32,  offset [*stack, E] float32

all `QuantizedExpertWeight`s. In FP8 (`Fp8Experts`, `load_in_fp8`, or an FP8 checkpoint's experts as stored):

    q [*stack, E, out, in] float8_e4m3fn,  scale [*stack, E, out / bm, in / bn] float32

`Fp8ExpertWeight`s, one scale per bm x bn block of each expert's torch-layout [out, in] matrix: a scale per output
channel (bm = 1, bn = in) when jaxft quantises, the checkpoint's blocks (transformers' 128 x 128) when it loads
FP8 as stored. Both are `QuantizedExperts`.

The MoE block calls `expert_matmul(xs, weight, sizes)` on one layer's slice: for a `Quant4bitExperts` that is
`kernels_pallas.nf4_matmul.nf4_grouped_matmul`, for an `Fp8Experts` `kernels_pallas.fp8_matmul.fp8_grouped_matmul`
(the layer's experts dequantised to the compute dtype inside the op's custom VJP, forward and again in the
backward; nothing dequantised is saved, so a step holds one layer's dequantised experts at most), for an
`ExpertParam` the plain grouped matmul; either way the grouped matmul is the one `gmm_implementation` names
(`ExecutionConfig.grouped_matmul_implementation`, handed down by the block). `expert_weight` gives the dense stack
(merged exports, LoRA merges).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxft.models.layers import ExpertParam, Fp8ExpertWeight, QuantizedExpertWeight, StackRow, init_4bit_buffers
from jaxft.quant.blockwise import dequantize_absmax
from kernels_pallas import fp8_matmul as fp8_ops
from kernels_pallas import nf4_matmul as nf4_ops
from kernels_pallas.grouped_matmul import grouped_matmul

__all__ = ["Fp8Experts", "Quant4bitExperts", "QuantizedExperts", "expert_matmul", "expert_weight"]


class QuantizedExperts(nnx.Module):
    """A frozen expert stack in a storage format of its own (4-bit or FP8): its dense `shape` [*lead, E, in, out],
    `dequantize(dtype)` (every layer), and `matmul(xs, group_sizes, gmm_implementation)` on one layer's slice.
    `kind` names the format in messages."""

    kind = "quantised"

    def dequantize(self, dtype) -> jax.Array:
        raise NotImplementedError

    def matmul(self, xs: jax.Array, group_sizes: jax.Array, gmm_implementation: str = "auto") -> jax.Array:
        raise NotImplementedError


class Quant4bitExperts(QuantizedExperts):
    """A stack of E frozen 4-bit expert weights of width in -> out (see the module docstring).

    `shape` is that of the dense weight it stands for, [*lead, E, in, out], with the lead axes of the arrays it
    holds now (the layer axis outside the layer loop, none on one layer's slice), as `ExpertParam.shape`."""

    kind = "4-bit"

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


class Fp8Experts(QuantizedExperts):
    """A stack of E frozen FP8 expert weights of width in -> out (see the module docstring): codes q
    [*lead, E, out, in] and a scale per `block` = (bm, bn) of each expert's [out, in] matrix (default (1, in): per
    output channel). `shape` as `Quant4bitExperts.shape`. `source_dtype`: the dtype the exports write (the model's)."""

    kind = "FP8"

    def __init__(self, num_experts: int, in_features: int, out_features: int, *, stack: tuple[int, ...],
                 block: tuple[int, int] | None = None, source_dtype: str = "bfloat16", arrays: dict | None = None):
        # `arrays` ({q, scale}) fills the variables instead of zeros.
        bm, bn = block or (1, in_features)
        if out_features % bm or in_features % bn:
            raise ValueError(f"Fp8Experts: block ({bm}, {bn}) does not tile an expert's [{out_features}, "
                             f"{in_features}] weight")
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.block, self.source_dtype = (int(bm), int(bn)), source_dtype
        lead = (*stack, num_experts)
        shapes = dict(q=((*lead, out_features, in_features), fp8_ops.E4M3),
                      scale=((*lead, out_features // bm, in_features // bn), jnp.float32))
        for name, (shape, dtype) in shapes.items():
            value = jnp.zeros(shape, dtype) if arrays is None else arrays[name]
            if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
                raise ValueError(f"Fp8Experts.{name}: got {value.dtype} {tuple(value.shape)}, expected "
                                 f"{jnp.dtype(dtype)} {tuple(shape)} for {num_experts} experts [{out_features}, "
                                 f"{in_features}] in blocks of ({bm}, {bn})")
            setattr(self, name, Fp8ExpertWeight(value))

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.q.shape[:-2], self.in_features, self.out_features)

    def dequantize(self, dtype) -> jax.Array:
        """The dense stack [*lead, E, in, out] in `dtype` (every layer held: for exports and merges, not steps)."""
        return jnp.swapaxes(fp8_ops.dequantize_blocks(self.q[...], self.scale[...], dtype), -1, -2)

    def matmul(self, xs: jax.Array, group_sizes: jax.Array, gmm_implementation: str = "auto") -> jax.Array:
        """gmm(xs, W) on ONE layer's experts (the slice the layer loop passes), dequantised in xs's dtype inside
        the op's custom VJP; its grouped matmuls (forward and backward) are `gmm_implementation`'s."""
        if self.q.ndim != 3:
            raise ValueError(f"Fp8Experts.matmul: called on a stack {self.q.shape[:-2]}; the MoE block runs on one "
                             "layer's experts [E, ...] (inside the layer loop)")
        return fp8_ops.fp8_grouped_matmul(xs, self.q[...], self.scale[...], group_sizes,
                                          gmm_implementation=gmm_implementation)


def expert_matmul(xs: jax.Array, weight, group_sizes: jax.Array, gmm_implementation: str = "auto", *,
                  lora=None, adapter=None) -> jax.Array:
    """out[m] = xs[m] @ W_g(m) for one layer's expert weight: an `ExpertParam` [E, in, out] (cast to xs's dtype)
    or holding a `StackRow` of its stack (in a layer scan), or `QuantizedExperts` (4-bit, FP8), by the grouped
    matmul `gmm_implementation` names (`kernels_pallas.grouped_matmul`). With `lora` = (xa [M, r], b [E, r, out])
    (`ExpertLora.sorted_factors`) plus gmm(xa, b); with `adapter` = (a [E, in, r], b [E, r, out])
    (`ExpertLora.grouped_adapter`) plus gmm(gmm(xs, a), b): in the same grouped matmul (`grouped_matmul(...,
    lora= / adapter=)`), or for quantised experts as products of their own."""
    gmm = functools.partial(grouped_matmul, implementation=gmm_implementation, lora=lora, adapter=adapter)
    if isinstance(weight, QuantizedExperts):
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
    """The dense stack of an expert weight: the `ExpertParam`'s value (cast to `dtype` if given), or the quantised
    stack dequantised in `dtype` (default: its `source_dtype`)."""
    if isinstance(weight, QuantizedExperts):
        return weight.dequantize(dtype or jnp.dtype(weight.source_dtype))
    if not isinstance(weight, ExpertParam):
        raise TypeError(f"expert_weight: {type(weight).__name__} is not an expert stack")
    return weight[...] if dtype is None else weight[...].astype(dtype)
