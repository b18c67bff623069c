"""Linear layers with optional LoRA, the LoRA variable types, and the recompute helper of the blocks.

Every module is created with *stacked* parameters (a leading layer axis, `stack=(L,)`) and called on one
layer's parameters: a slice inside `jax.lax.scan` (compile time does not grow with depth), or, for a
training step over per-layer weight buffers (`jaxft.train.unstack_layers`), one unrolled call per layer
(no weight-slicing copies). The variable types carry
meaning: `nnx.Param` is the frozen base, `TrainableParam`s are what training updates (`LoraParam` adapter
matrices, `SavedParam` base matrices trained in full, `TokenRows` trained rows of a table), `LoraScale` is a per-layer
constant, `QuantizedWeight` is a frozen 4-bit weight's storage and `Fp8Weight` a frozen FP8 weight's (a `Linear`
whose `quant` is set has no `kernel`); `ExpertParam` is a MoE expert stack, `QuantizedExpertWeight` the storage of
one in 4 bits, `Fp8ExpertWeight` in FP8.
Optimisers, the trainer and the exporters select by type, never by name.

Every parameter also names its dimensions where it is created (`logical(...)`, kept as the Variable's
"logical_axes" metadata): the stack axis is "layers", a Linear's input and output axes are given by the
block that builds it ("embed", "heads", "mlp", ...). `jaxft.sharding.RULES` maps these names to mesh axes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxft.quant.blockwise import dequantize_absmax
from kernels_pallas import fp8_matmul as fp8_ops
from kernels_pallas import nf4_matmul as nf4_ops


# The names a parameter dimension can have (see `jaxft.sharding` for what each is split over).
LOGICAL_AXES = ("layers", "embed", "mlp", "heads", "kv_heads", "vocab", "experts", "norm", "lora_rank",
                "quant_bytes")  # quant_bytes: a 4-bit record's flat codes or block scales (`Quant4bit`)
_METADATA_KEY = "logical_axes"


def logical(*names: str | None) -> dict[str, tuple[str | None, ...]]:
    """The Variable metadata naming each dimension: `nnx.Param(value, **logical("layers", "embed", "mlp"))`."""
    bad = [n for n in names if n is not None and n not in LOGICAL_AXES]
    if bad:
        raise ValueError(f"unknown logical axis {bad[0]!r}; known: {', '.join(LOGICAL_AXES)}")
    return {_METADATA_KEY: tuple(names)}


def logical_axes(var: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names a Variable declares (None: none declared, the array is kept whole)."""
    return var.get_metadata().get(_METADATA_KEY)


def stack_axes(stack: tuple[int, ...]) -> tuple[str, ...]:
    """The names of a module's leading stack axes (one "layers" axis for a layer stack, none otherwise)."""
    if len(stack) > 1:
        raise ValueError(f"stack={stack}: one stack axis at most (the layer axis)")
    return ("layers",) * len(stack)


class TrainableParam(nnx.Param):
    """What training differentiates and updates (fp32): the only variable types that receive gradients."""


class LoraParam(TrainableParam):
    """A trainable low-rank adapter matrix (fp32)."""


class SavedParam(TrainableParam):
    """A base matrix trained in full (fp32 master copy; PEFT's `modules_to_save`): the embedding table or the
    output head's kernel, in the layout of the frozen variable it replaces."""


class TokenRows(TrainableParam):
    """Trained rows [n, H] of a table (PEFT's trainable tokens): row k replaces the table's row `TokenIds[k]`
    (the embedding's rows; the output head's vocabulary columns of its [H, V] kernel)."""


class TokenIds(nnx.Variable):
    """The int32 token ids [n] whose rows `TokenRows` replaces. Not trained."""


def with_token_rows(table: jax.Array, holder, vocab_axis: int = 0) -> jax.Array:
    """`table` with the rows (vocab_axis 0: [V, H]) or columns (1: an [H, V] kernel) `holder.token_ids` replaced by
    `holder.token_rows` (PEFT's index_copy: the gradient of a replaced row reaches the trained row only); `table`
    itself where `holder` has no trained rows."""
    rows = getattr(holder, "token_rows", None)
    if rows is None:
        return table
    ids, values = holder.token_ids[...], rows[...].astype(table.dtype)
    return table.at[ids].set(values) if vocab_axis == 0 else table.at[:, ids].set(values.T)


class LoraScale(nnx.Variable):
    """Per-layer LoRA scaling alpha/r (or alpha/sqrt(r)); 0 where the layer is not targeted. Not trained."""


class LoraRank(nnx.Variable):
    """Per-layer effective rank (int32): adapters are zero-padded to the largest rank of the stack."""


class QuantizedWeight(nnx.Variable):
    """Storage of a frozen 4-bit weight (packed codes, absmax, nested absmax, offset): never differentiated,
    never given optimiser state, never a `Param` (so exporters and loaders that walk `Param`s skip it)."""


class Fp8Weight(QuantizedWeight):
    """Storage of a frozen FP8 weight (float8_e4m3fn codes and their per-output-channel scales, `QuantFp8`): a
    `QuantizedWeight`, so whatever skips those (optimisers, gradients, exporters of `Param`s) skips it too."""


class ExpertParam(nnx.Param):
    """A stack of MoE expert weights [*stack, E, in, out] (frozen, like any `nnx.Param`): what `load_in_4bit`
    stores in 4 bits as a `jaxft.models.quant_experts.Quant4bitExperts`, `load_in_fp8` in FP8 as an `Fp8Experts`
    (selected by this type). Inside a layer scan its value is a `StackRow` (`jaxft.models.stack`), which
    `expert_matmul` reads in place."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackRow:
    """Row `row` (int32 scalar, traced) of a layer stack `stack` [L, ...], not sliced out. A layer scan gives one
    to the `ExpertParam`s of each layer: a slice handed to a custom call (the Mosaic grouped matmul) is first copied
    out whole, 1.48 GiB a layer for GPT-OSS-20B, so the grouped matmul reads the row in place instead
    (`kernels_pallas.grouped_matmul`'s `row=`)."""

    stack: jax.Array
    row: jax.Array

    @property
    def dtype(self):
        return self.stack.dtype

    def sliced(self) -> jax.Array:
        """The row as an array of its own (a copy, where a custom call reads it)."""
        return jax.lax.dynamic_index_in_dim(self.stack, self.row, 0, keepdims=False)


class QuantizedExpertWeight(QuantizedWeight):
    """Storage of a stack of frozen 4-bit expert weights (one bitsandbytes record per expert); a
    `QuantizedWeight`, so whatever skips those (optimisers, gradients, exporters of `Param`s) skips it too."""


class Fp8ExpertWeight(QuantizedExpertWeight):
    """Storage of a stack of frozen FP8 expert weights (float8_e4m3fn codes and their block scales,
    `jaxft.models.quant_experts.Fp8Experts`); skipped wherever a `QuantizedWeight` is."""


def init_4bit_buffers(module: nnx.Module, lead: tuple[int, ...], out_features: int, in_features: int, *,
                      blocksize: int, double_quant: bool, nested_blocksize: int, arrays: dict | None,
                      var_type: type, what: str, split: bool = False) -> None:
    """Sets `module`'s 4-bit variables, each a `var_type` with the leading axes `lead`, one bitsandbytes record
    of an [out, in] matrix per leading index: packed [ceil(out*in/2)] uint8, absmax [blocks] (float32, or uint8
    codes with double quantisation, then nested_absmax [ceil(blocks/nested_blocksize)] float32 and offset []
    float32; both None without). Zeros, or `arrays` checked against those shapes (`what` names the matrix in the
    error). `split`: packed and absmax name their flat axis "quant_bytes" (split over fsdp on a mesh); otherwise
    no variable declares axes (whole on every device)."""
    n = out_features * in_features
    blocks = -(-n // blocksize)
    shapes = dict(packed=((*lead, -(-n // 2)), jnp.uint8),
                  absmax=((*lead, blocks), jnp.uint8 if double_quant else jnp.float32))
    if double_quant:
        shapes.update(nested_absmax=((*lead, -(-blocks // nested_blocksize)), jnp.float32),
                      offset=(lead, jnp.float32))
    for name, (shape, dtype) in shapes.items():
        value = jnp.zeros(shape, dtype) if arrays is None else arrays[name]
        if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
            raise ValueError(f"{type(module).__name__}.{name}: got {value.dtype} {tuple(value.shape)}, expected "
                             f"{jnp.dtype(dtype)} {tuple(shape)} for {what} in blocks of {blocksize}")
        flat = split and name in ("packed", "absmax")
        setattr(module, name, var_type(value, **(logical(*(None,) * len(lead), "quant_bytes") if flat else {})))
    if not double_quant:
        module.nested_absmax = module.offset = None


class Quant4bit(nnx.Module):
    """A stack of frozen [out, in] weights in bitsandbytes' 4-bit format (`jaxft.quant.blockwise`), per layer:

    packed [ceil(out*in/2)] uint8, absmax [blocks] (float32, or uint8 codes with double quantisation, then
    nested_absmax [ceil(blocks/nested_blocksize)] float32 and offset [] float32). `source_dtype` is the dtype
    the weight was quantised from (written back into the checkpoint's quant state).
    """

    def __init__(self, out_features: int, in_features: int, *, stack: tuple[int, ...], quant_type: str = "nf4",
                 blocksize: int = 64, double_quant: bool = True, nested_blocksize: int = 256,
                 source_dtype: str = "bfloat16", arrays: dict | None = None):
        # `arrays` ({packed, absmax[, nested_absmax, offset]}) fills the variables instead of zeros.
        self.out_features, self.in_features = out_features, in_features
        self.quant_type, self.blocksize, self.nested_blocksize = quant_type, blocksize, nested_blocksize
        self.source_dtype = source_dtype
        init_4bit_buffers(self, stack, out_features, in_features, blocksize=blocksize, double_quant=double_quant,
                          nested_blocksize=nested_blocksize, arrays=arrays, var_type=QuantizedWeight,
                          what=f"a [{out_features}, {in_features}] weight", split=True)

    @property
    def double_quant(self) -> bool:
        return self.nested_absmax is not None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def lead(self) -> tuple[int, ...]:
        """The stack axes (the layer axis of a layer stack; none for a single linear)."""
        return tuple(self.packed.shape[:-1])

    def _get(self, var, layer):
        value = _whole(var[...])
        return value if layer is None else value[layer]

    def absmax_f32(self, layer: int | None = None) -> jax.Array:
        """The float32 block absmax (de-nested when double-quantised) of the layer the module holds, or of
        `layer` of a stack."""
        absmax = self._get(self.absmax, layer)
        if not self.double_quant:
            return absmax
        return dequantize_absmax(absmax, self._get(self.nested_absmax, layer), self._get(self.offset, layer),
                                 self.nested_blocksize)

    def dequantize(self, dtype, layer: int | None = None) -> jax.Array:
        """The weight as [in, out] in `dtype` (the layout of `Linear.kernel`), of one layer (see absmax_f32)."""
        w = nf4_ops.dequantize_4bit(self._get(self.packed, layer), self.absmax_f32(layer), shape=self.shape,
                                    blocksize=self.blocksize, quant_type=self.quant_type, dtype=dtype)
        return w.T

    def matmul(self, x: jax.Array) -> jax.Array:
        """x [..., in] @ W -> [..., out], dequantising in x's dtype inside the op's custom VJP (the dequantised
        weight lives only inside this layer's forward and backward)."""
        return nf4_ops.nf4_matmul(x, self._get(self.packed, None), self.absmax_f32(), shape=self.shape,
                                  blocksize=self.blocksize, quant_type=self.quant_type)


class QuantFp8(nnx.Module):
    """A stack of frozen [out, in] weights in FP8 (`kernels_pallas.fp8_matmul`), per layer: q [out, in]
    float8_e4m3fn and scale [out] float32, W ~= q * scale[:, None]. Stored in torch's [out, in] layout, whose
    contraction axis is the minor one, as the FP8 GEMMs take it in the forward. The codes name the linear's
    logical axes (`axes`: (in, out), as `Linear.axes`), so a mesh splits them as it would the kernel.
    `implementation`: the fp8_matmul implementation ("auto": FP8 GEMMs on FP8 tensor cores, else dequantised
    to the compute dtype)."""

    def __init__(self, out_features: int, in_features: int, *, stack: tuple[int, ...],
                 axes: tuple[str | None, str | None] = (None, None), implementation: str = "auto",
                 arrays: dict | None = None):
        # `arrays` ({q, scale}) fills the variables instead of zeros.
        self.out_features, self.in_features = out_features, in_features
        self.implementation = implementation
        lead = stack_axes(stack)
        shapes = dict(q=((*stack, out_features, in_features), fp8_ops.E4M3, (*lead, axes[1], axes[0])),
                      scale=((*stack, out_features), jnp.float32, (*lead, axes[1])))
        for name, (shape, dtype, names) in shapes.items():
            value = jnp.zeros(shape, dtype) if arrays is None else arrays[name]
            if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
                raise ValueError(f"QuantFp8.{name}: got {value.dtype} {tuple(value.shape)}, expected "
                                 f"{jnp.dtype(dtype)} {tuple(shape)} for a [{out_features}, {in_features}] weight")
            setattr(self, name, Fp8Weight(value, **logical(*names)))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def lead(self) -> tuple[int, ...]:
        """The stack axes (the layer axis of a layer stack; none for a single linear)."""
        return tuple(self.q.shape[:-2])

    def dequantize(self, dtype, layer: int | None = None) -> jax.Array:
        """The weight as [in, out] in `dtype` (the layout of `Linear.kernel`), of the layer the module holds or
        of `layer` of a stack."""
        q, scale = self.q[...], self.scale[...]
        if layer is not None:
            q, scale = q[layer], scale[layer]
        return fp8_ops.dequantize_fp8(q, scale, dtype).T

    def matmul(self, x: jax.Array) -> jax.Array:
        """x [..., in] @ W -> [..., out] in x's dtype (`kernels_pallas.fp8_matmul`)."""
        return fp8_ops.fp8_matmul(x, self.q[...], self.scale[...], implementation=self.implementation)


def _whole(x: jax.Array) -> jax.Array:
    """`x` whole on every device when traced under a mesh (`Placement.tracing()`; not inside a shard_map, whose
    operands are local already), else as it is. Why: under FSDP the 4-bit codes and scales are split
    ("quant_bytes"); gathering them before they are decoded moves 4 bits a weight, where letting XLA decode the
    shards and gather the result could move the decoded 16."""
    mesh = jax.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes:
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec())


def _init(rngs: nnx.Rngs | None, shape, dtype, std: float | None):
    if std is None:
        return jnp.ones(shape, dtype)
    if rngs is None:
        return jnp.zeros(shape, dtype)
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)


class Linear(nnx.Module):
    """y = x @ W (+ b) (+ s * dropout(x) @ A @ B).  W: [in, out] (transposed w.r.t. torch's [out, in])."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, stack: tuple[int, ...], dtype,
                 rngs: nnx.Rngs | None, std: float = 0.02, axes: tuple[str | None, str | None] = (None, None)):
        self.in_features, self.out_features = in_features, out_features
        self.axes = tuple(axes)  # logical names of the input and output dimensions (static)
        lead = stack_axes(stack)
        self.kernel = nnx.Param(_init(rngs, (*stack, in_features, out_features), dtype, std),
                                **logical(*lead, *self.axes))
        self.bias = (nnx.Param(jnp.zeros((*stack, out_features), dtype), **logical(*lead, self.axes[1]))
                     if bias else None)
        self.lora_a: LoraParam | None = None
        self.lora_b: LoraParam | None = None
        self.lora_scale: LoraScale | None = None
        self.lora_rank: LoraRank | None = None
        self.lora_dropout: float = 0.0
        # set (and `kernel` dropped) by jaxft.quant: a frozen 4-bit or FP8 weight
        self.quant: Quant4bit | QuantFp8 | None = None
        # A stacked linear 4-bit in some layers and dense in others (bitsandbytes' per-layer
        # llm_int8_skip_modules): True per stack row stored in 4 bits; `kernel` then holds the dense rows
        # alone and `quant` the 4-bit rows, each in stack order. The layer loops hand each layer one of the two
        # (the other's value None: `jaxft.models.stack`).
        self.quant_rows: tuple[bool, ...] | None = None

    @property
    def has_lora(self) -> bool:
        return self.lora_a is not None

    def base(self, x: jax.Array) -> jax.Array:
        """x @ W (+ b): the frozen part."""
        if self.quantized_here:
            y = self.quant.matmul(x)
        else:
            y = jnp.einsum("...i,io->...o", x, self.kernel[...].astype(x.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y

    @property
    def quantized_here(self) -> bool:
        """Whether the weight this module holds is `quant`'s: a mixed linear's layer (see `quant_rows`) holds
        either its dense row (quant's values None) or its 4-bit row (the kernel's value None)."""
        if self.quant is None:
            return False
        return self.quant_rows is None or self.kernel.get_value() is None

    def frozen_kernel(self, dtype=None) -> jax.Array:
        """W [*stack, in, out]: the kernel, or the 4-bit / FP8 weight dequantised (every layer) in `dtype`."""
        if self.quant_rows is not None:  # dense and 4-bit rows back in stack order
            dense, rows, d, q = self.kernel[...], [], 0, 0
            dtype = dtype or dense.dtype
            for four in self.quant_rows:
                rows.append(self.quant.dequantize(dtype, q) if four else dense[d].astype(dtype))
                q, d = q + four, d + (not four)
            return jnp.stack(rows)
        if self.quant is None:
            return self.kernel[...] if dtype is None else self.kernel[...].astype(dtype)
        dtype = dtype or jnp.bfloat16
        lead = self.quant.lead
        if not lead:
            return self.quant.dequantize(dtype)
        return jnp.stack([self.quant.dequantize(dtype, i) for i in range(lead[0])])

    def __call__(self, x: jax.Array, dropout_rng: jax.Array | None = None) -> jax.Array:
        return project((self,), x, (dropout_rng,))[0]

    def scaled_b(self, dtype) -> jax.Array:
        """s * B in the compute dtype: the scale is folded into the [r, out] matrix so that no [tokens, out]
        tensor is ever multiplied by it, forward or backward (dL/dB = s * (xA)^T dy comes out of the same
        small product)."""
        return (self.lora_b[...] * self.lora_scale[...]).astype(dtype)


def _dropped(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
    if rate <= 0.0 or rng is None:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def project(lins: tuple[Linear, ...], x: jax.Array, rngs: tuple) -> list[jax.Array]:
    """[lin(x) for lin in lins] for linears that read the same input (q/k/v; gate/up).

    y_i = x W_i + (x A_i)(s_i B_i). The adapters' down-projections share one matmul: x [A_1 | A_2 | ...]
    reads x once instead of once per linear, and in the backward pass autodiff turns the concatenation into
    one dx = [dxa_1 | dxa_2 | ...] [A_1 | A_2 | ...]^T and one dA = x^T [dxa_1 | ...]: the rank-r GEMMs are
    memory-bound on the [tokens, in] operand, so this removes (n-1) of n passes over it each way. With LoRA
    dropout each adapter sees its own mask of x, so nothing is shared.
    """
    ys = [lin.base(x) for lin in lins]
    with_lora = [i for i, lin in enumerate(lins) if lin.has_lora]
    if not with_lora:
        return ys
    with jax.named_scope("lora"):
        dropout = any(lins[i].lora_dropout > 0.0 and rngs[i] is not None for i in with_lora)
        if dropout:
            xas = [jnp.einsum("...i,ir->...r", _dropped(x, lins[i].lora_dropout, rngs[i]),
                              lins[i].lora_a[...].astype(x.dtype)) for i in with_lora]
        else:
            a = jnp.concatenate([lins[i].lora_a[...] for i in with_lora], axis=-1).astype(x.dtype)
            xa = jnp.einsum("...i,ir->...r", x, a)
            cuts = list(np.cumsum([lins[i].lora_a.shape[-1] for i in with_lora])[:-1])
            xas = jnp.split(xa, cuts, axis=-1)
        for i, xa_i in zip(with_lora, xas):
            ys[i] = ys[i] + jnp.einsum("...r,ro->...o", xa_i, lins[i].scaled_b(x.dtype))
    return ys


def _recompute(fn, prevent_cse: bool = False):
    """`fn` rematerialised in the backward pass with nothing saved but its inputs.

    Used around [elementwise op -> frozen linear (+ LoRA)] regions: the backward needs the elementwise op's
    output only as the LoRA input (for dA), so recomputing it from the region's input replaces a saved
    [tokens, width] tensor with an elementwise pass; the frozen matmul itself is linear in its input and is
    not recomputed (its forward output is not needed by any backward rule).
    """
    # prevent_cse=False inside the layer scan: its forward and backward loops are separate, so XLA cannot
    # merge the recomputation back into the forward, and the barriers would only constrain fusion. Unrolled
    # layers (the decoder passes ctx["prevent_cse"]) need them.
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=prevent_cse)


def linears(module: nnx.Module):
    """(dotted path, Linear) for every Linear under `module`, in a stable order."""
    out = []
    for path, node in nnx.iter_graph(module):
        if isinstance(node, Linear):
            out.append((".".join(str(p) for p in path), node))
    return sorted(out, key=lambda item: item[0])
