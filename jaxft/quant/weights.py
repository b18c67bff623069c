"""Frozen linears as 4-bit weights: which ones (`QuantConfig`, by HF module name and by measured error), the
quantisation of loaded weights one layer at a time on the device, and bitsandbytes checkpoint records.

A quantised `Linear` keeps its bias and LoRA slots; its `kernel` is replaced by `quant`, a `Quant4bit` module
whose variables are `QuantizedWeight`s (`jaxft.models.layers`): trainable and quantised state are told apart
by variable type. A site (one linear of the layer stack, all layers) may be 4-bit in some layers and dense in
others (bitsandbytes' per-layer `llm_int8_skip_modules`, as Unsloth's dynamic 4-bit checkpoints store them; a
layer over `max_rel_error`): the `Linear` then holds the dense rows as its kernel and the 4-bit rows as `quant`
(`Linear.quant_rows` says which row is which), so neither format costs memory in the other's layers.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from bridge import bnb4bit, checkpoint_files, read_config
from bridge.bnb4bit import Quant4bitTensor
from bridge.mappings.schema import LAYER
from jaxft.errors import ConfigError
from jaxft.families import family_for
from jaxft.models.layers import Linear, Quant4bit, linears
from jaxft.models.stack import layer_stacks
from jaxft.quant.blockwise import quantize_4bit
from jaxft.quant.config import DEFAULT_SKIP, QuantConfig, is_skipped
from jaxft.quant.experts import abstract_experts, checkpoint_fp8_blocks
from kernels_pallas.nf4_matmul import DYNAMIC, code_4bit, dequantize_4bit

__all__ = ["DEFAULT_SKIP", "QuantConfig", "Site", "abstract_quantize", "four_bit_rows", "install", "is_skipped",
           "layer_saving", "linear_sites", "quantize_site", "records_of", "saved_bytes", "site_from_records"]

@dataclasses.dataclass(frozen=True)
class Site:
    """One `Linear` of the model: its tree path (without "kernel"), HF module template, stacked over layers
    (`layers`: the HF layer of each row of its stack, `jaxft.models.stack.layer_stacks`)."""

    path: tuple[str, ...]
    template: str
    stacked: bool
    layers: tuple[int, ...] = ()

    def names(self) -> list[str]:
        if not self.stacked:
            return [self.template]
        return [self.template.replace(LAYER, str(i)) for i in self.layers]

    def linear(self, model) -> Linear:
        node = model
        for part in self.path:
            node = getattr(node, part)
        return node


def linear_sites(model) -> list[Site]:
    """Every `Linear` of `model` with its HF module name (bridge table rows `<module>.weight -> <path>.kernel`)."""
    present = {tuple(p.split(".")) for p, _ in linears(model)}
    stacks = layer_stacks(model.config)
    out = []
    for row in family_for(model.config.model_type).table:
        if row.path[-1] == "kernel" and row.path[:-1] in present and row.hf.endswith(".weight"):
            out.append(Site(row.path[:-1], row.hf[: -len(".weight")], row.stacked, stacks.get(row.path[0], ())))
    return out


def install(lin: Linear, quant: Quant4bit, rows: tuple[bool, ...] | None = None, dense=None) -> None:
    """Makes `lin` a 4-bit linear: `quant` replaces its kernel; or, with `rows` (True per stack row in 4 bits)
    not all True, a mixed one: `quant` holds the 4-bit rows and the kernel keeps the dense ones (`dense`
    [rows, in, out] sets it here; None: the caller fills it, e.g. a loader's host arrays)."""
    # `nnx.data` / `nnx.static`: `quant` was None (static) on the fresh Linear and now holds state; the kernel
    # goes away (None, static), so nothing can read a stale float copy.
    lin.quant = nnx.data(quant)
    if rows is not None and not all(rows):
        lin.quant_rows = tuple(bool(r) for r in rows)
        if dense is not None:
            lin.kernel = lin.kernel.replace(dense)
        return
    lin.kernel = nnx.static(None)


def four_bit_rows(lin: Linear, layers: int) -> tuple[bool, ...]:
    """True per stack row that `lin` holds in 4 bits (all of them for a plain 4-bit linear, none for a dense one)."""
    if lin.quant_rows is not None:
        return lin.quant_rows
    return (lin.quant is not None,) * layers


def _layers_of(kernel: np.ndarray, stacked: bool):
    return [kernel[i] for i in range(kernel.shape[0])] if stacked else [kernel]


def _stack(parts: list, stacked: bool):
    return jnp.stack(parts) if stacked else parts[0]


def quantize_site(kernel: np.ndarray, stacked: bool, cfg: QuantConfig, source_dtype: str,
                  keep: list[bool] | None = None) -> tuple[Quant4bit | None, tuple[bool, ...], list[float | None]]:
    """(Quant4bit of the layers in 4 bits, True per layer in 4 bits, relative error per layer) of a host kernel
    [L?, in, out], one layer on the device at a time. A layer stays dense when `keep` says so (skipped by name;
    error None) or when its error exceeds `cfg.max_rel_error`; the Quant4bit is None when every layer does."""
    packed, absmax, nested, offsets, four, errors = [], [], [], [], [], []
    in_f, out_f = kernel.shape[-2:]
    for i, layer in enumerate(_layers_of(kernel, stacked)):
        if keep is not None and keep[i]:
            four.append(False)
            errors.append(None)
            continue
        w = jnp.asarray(layer).T  # torch's [out, in]: the blocks run along `in`
        q = quantize_4bit(w, quant_type=cfg.quant_type, blocksize=cfg.blocksize, double_quant=cfg.double_quant,
                          nested_blocksize=cfg.nested_blocksize, nested_rounding=cfg.nested_rounding)
        err = None
        if cfg.max_rel_error is not None:
            back = dequantize_4bit(q.packed, q.absmax_f32(), shape=q.shape, blocksize=cfg.blocksize,
                                   quant_type=cfg.quant_type, dtype=jnp.float32)
            w32 = w.astype(jnp.float32)
            err = float(jnp.linalg.norm(back - w32) / jnp.maximum(jnp.linalg.norm(w32), 1e-30))
        errors.append(err)
        del w
        if err is not None and err > cfg.max_rel_error:
            four.append(False)
            continue
        four.append(True)
        packed.append(q.packed)
        absmax.append(q.absmax)
        if cfg.double_quant:
            nested.append(q.nested_absmax)
            offsets.append(jnp.float32(q.offset))
    if not packed:
        return None, tuple(four), errors
    arrays = dict(packed=_stack(packed, stacked), absmax=_stack(absmax, stacked))
    if cfg.double_quant:
        arrays.update(nested_absmax=_stack(nested, stacked), offset=_stack(offsets, stacked))
    return _module(out_f, in_f, stacked, cfg.quant_type, cfg.blocksize, cfg.double_quant, cfg.nested_blocksize,
                   source_dtype, arrays), tuple(four), errors


def _module(out_f, in_f, stacked, quant_type, blocksize, double_quant, nested_blocksize, source_dtype, arrays):
    lead = (arrays["packed"].shape[0],) if stacked else ()
    return Quant4bit(out_f, in_f, stack=lead, quant_type=quant_type, blocksize=blocksize, double_quant=double_quant,
                     nested_blocksize=nested_blocksize, source_dtype=source_dtype, arrays=arrays)


def site_from_records(records: list[Quant4bitTensor], stacked: bool, where: str) -> Quant4bit:
    """A Quant4bit from a checkpoint's per-layer records (checked to share one format and the standard codes)."""
    first = records[0]
    for r in records:
        same = (r.shape, r.blocksize, r.quant_type, r.double_quant, r.nested_blocksize) == \
               (first.shape, first.blocksize, first.quant_type, first.double_quant, first.nested_blocksize)
        if not same:
            raise ConfigError(f"{where}: the layers of this module are quantised differently ({r.quant_type}, "
                              f"blocksize {r.blocksize}, double quant {r.double_quant} vs {first.quant_type}, "
                              f"{first.blocksize}, {first.double_quant}); re-quantise the checkpoint uniformly")
        if not np.array_equal(r.quant_map, code_4bit(r.quant_type)):
            raise ConfigError(f"{where}: quant_map is not bitsandbytes' standard {r.quant_type} code; only the "
                              "standard NF4/FP4 tables are supported")
        if r.double_quant and not np.array_equal(r.nested_quant_map, DYNAMIC):
            raise ConfigError(f"{where}: nested_quant_map is not bitsandbytes' dynamic 8-bit map; only the "
                              "standard map is supported")
    arrays = dict(packed=_stack([jnp.asarray(r.packed) for r in records], stacked),
                  absmax=_stack([jnp.asarray(r.absmax) for r in records], stacked))
    if first.double_quant:
        arrays.update(nested_absmax=_stack([jnp.asarray(r.nested_absmax) for r in records], stacked),
                      offset=_stack([jnp.float32(r.nested_offset) for r in records], stacked))
    out_f, in_f = first.shape
    return _module(out_f, in_f, stacked, first.quant_type, first.blocksize, first.double_quant,
                   first.nested_blocksize or 256, first.dtype, arrays)


def records_of(quant: Quant4bit, stacked: bool) -> list[Quant4bitTensor]:
    """Per-layer checkpoint records of a Quant4bit (host copies)."""
    layers = quant.packed.shape[0] if stacked else 1
    out = []
    for i in range(layers):
        def get(var):
            value = np.asarray(var[...])
            return value[i] if stacked else value
        out.append(Quant4bitTensor(
            packed=get(quant.packed), absmax=get(quant.absmax), quant_map=code_4bit(quant.quant_type),
            shape=quant.shape, blocksize=quant.blocksize, quant_type=quant.quant_type, dtype=quant.source_dtype,
            nested_absmax=get(quant.nested_absmax) if quant.double_quant else None,
            nested_quant_map=DYNAMIC if quant.double_quant else None,
            nested_offset=float(get(quant.offset)) if quant.double_quant else None,
            nested_blocksize=quant.nested_blocksize if quant.double_quant else None))
    return out


def saved_bytes(quant: Quant4bit, dtype) -> int:
    """Device bytes the 4-bit form saves over the weight in `dtype`."""
    layers = math.prod(quant.packed.shape[:-1])
    dense = layers * quant.out_features * quant.in_features * jnp.dtype(dtype).itemsize
    held = sum(int(np.prod(v.shape)) * jnp.dtype(v.dtype).itemsize
               for v in (quant.packed, quant.absmax, quant.nested_absmax, quant.offset) if v is not None)
    return dense - held


def layer_saving(out_f: int, in_f: int, cfg: QuantConfig, dtype) -> int:
    """Device bytes one [out, in] layer saves in 4 bits (`cfg`'s format) over `dtype`: what keeping it dense costs."""
    n = out_f * in_f
    blocks = -(-n // cfg.blocksize)
    held = -(-n // 2) + blocks * (1 if cfg.double_quant else 4)
    if cfg.double_quant:
        held += 4 * -(-blocks // cfg.nested_blocksize) + 4
    return n * jnp.dtype(dtype).itemsize - held


def abstract_quantize(model, path, cfg: QuantConfig | None) -> None:
    """Installs the 4-bit modules `from_pretrained(path, quant_config=cfg)` would, with zero arrays (call it under
    `nnx.eval_shape` for shapes alone): for ahead-of-time compilation before the weights are read."""
    hf = read_config(path)
    stored = bnb4bit.quantization_config(hf, str(path))
    fp8_experts = checkpoint_fp8_blocks(model, path)  # an FP8 checkpoint's experts, kept as stored
    if stored is not None:
        records = bnb4bit.read_quantized(path, checkpoint_files(path))
        for site in linear_sites(model):
            present = [n for n in site.names() if n in records]
            if present:
                r, lin = records[present[0]], site.linear(model)
                rows = tuple(n in records for n in site.names())
                _install_abstract(lin, len(present), rows, site.stacked, quant_type=r.quant_type,
                                  blocksize=r.blocksize, double_quant=r.double_quant,
                                  nested_blocksize=r.nested_blocksize or 256, source_dtype=r.dtype)
        return
    if cfg is None:
        abstract_experts(model, None, fp8_experts)
        return
    if cfg.max_rel_error is not None:
        raise ValueError("QuantConfig.max_rel_error decides which modules stay dense from the weights themselves: "
                         "load the model (Run.load) before compiling")

    abstract_experts(model, cfg, fp8_experts)
    for site in linear_sites(model):
        rows = tuple(not is_skipped(n, cfg.skip_modules) for n in site.names())
        if any(rows):
            _install_abstract(site.linear(model), sum(rows), rows, site.stacked, quant_type=cfg.quant_type,
                              blocksize=cfg.blocksize, double_quant=cfg.double_quant,
                              nested_blocksize=cfg.nested_blocksize, source_dtype=str(model.dtype))


def _install_abstract(lin: Linear, count: int, rows: tuple[bool, ...], stacked: bool, **fmt) -> None:
    """A zero Quant4bit of `count` rows installed on `lin`, with zero dense rows for the others (mixed)."""
    dense = None
    if not all(rows):
        kernel = lin.kernel[...]
        dense = jnp.zeros((len(rows) - count, *kernel.shape[1:]), kernel.dtype)
    install(lin, Quant4bit(lin.out_features, lin.in_features, stack=(count,) if stacked else (), **fmt), rows, dense)
