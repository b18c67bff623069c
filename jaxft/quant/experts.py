"""MoE expert stacks in 4 bits (`load_in_4bit`) or FP8 (`load_in_fp8`): which ones (every `ExpertParam` of the
model, unless its HF name is in the config's `skip_modules`), their quantisation one layer at a time on the device,
an FP8 checkpoint's experts as stored, and their bytes.

Each layer's experts of one projection, [E, in, out] in our layout, are quantised as E torch-layout [out, in]
matrices in one program: in 4 bits vmapped (`jaxft.quant.blockwise.quantize_4bit_batch`), expert e's bytes those
of `bitsandbytes.functional.quantize_4bit(W_e.T)`; in FP8 with a scale per output channel of each expert
(`kernels_pallas.fp8_matmul.quantize_rows`, the dense FP8 linears' rounding). transformers keeps MoE experts as
3-D `nn.Parameter`s (not `nn.Linear`), so a bitsandbytes checkpoint never holds 4-bit experts: there is no record
format to read or write, and a quantised export writes them dequantised (`jaxft.io.save_pretrained`). An FP8
checkpoint (transformers' fine-grained FP8, compressed-tensors) stores each expert's [out, in] codes with its
scales (`bridge.fp8`): those load as stored, block scales and all (`stored_fp8_experts`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bridge import checkpoint_files, fp8, read_config
from bridge.mappings.schema import LAYER
from bridge.safetensors_io import read_header
from jaxft.families import family_for
from jaxft.models.layers import ExpertParam
from jaxft.models.quant_experts import Fp8Experts, Quant4bitExperts, QuantizedExperts
from jaxft.models.stack import layer_stacks
from jaxft.quant.blockwise import quantize_4bit_batch
from jaxft.quant.config import Fp8Config, QuantConfig, is_skipped
from kernels_pallas.fp8_matmul import quantize_rows

__all__ = ["ExpertSite", "checkpoint_fp8_blocks", "expert_sites", "install_experts", "quantize_experts",
           "saved_expert_bytes", "stored_fp8_experts"]

_quantize_rows = jax.jit(quantize_rows)


@dataclasses.dataclass(frozen=True)
class ExpertSite:
    """One expert stack of the model: its tree path (the MoE MLP's attribute), the HF name of the experts module
    and of the parameter (templates with the layer placeholder), and the HF layer of each row of its stack."""

    path: tuple[str, ...]
    module: str
    param: str
    layers: tuple[int, ...]

    def names(self) -> list[str]:
        """The HF names skip_modules is matched against, per layer: the experts module and the parameter."""
        return [t.replace(LAYER, str(i)) for i in self.layers for t in (self.module, self.param)]

    def holder(self, model):
        node = model
        for part in self.path[:-1]:
            node = getattr(node, part)
        return node


def expert_sites(model) -> list[ExpertSite]:
    """Every `ExpertParam` of `model` (selected by type), with its HF names from the family's table row."""
    rows = {row.path: row.hf for row in family_for(model.config.model_type).table}
    stacks = layer_stacks(model.config)
    out = []
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, ExpertParam):
            continue
        path = tuple(str(p) for p in path)
        hf = rows[path]  # e.g. model.layers.{i}.mlp.experts.{e}.gate_proj.weight / ...experts.gate_up_proj
        module = hf[: hf.index(".experts") + len(".experts")]
        out.append(ExpertSite(path, module, f"{module}.{path[-1]}", tuple(stacks.get(path[0], ()))))
    return sorted(out, key=lambda s: s.path)


def quantize_experts(kernel: np.ndarray, cfg: QuantConfig | Fp8Config, source_dtype: str) -> QuantizedExperts:
    """The 4-bit (`QuantConfig`) or FP8 (`Fp8Config`) stack of a host expert kernel [L, E, in, out], one layer on
    the device at a time."""
    layers, experts, in_f, out_f = kernel.shape
    if isinstance(cfg, Fp8Config):
        qs, scales = [], []
        for layer in range(layers):
            q, scale = _quantize_rows(jnp.swapaxes(jnp.asarray(kernel[layer]), 1, 2))  # [E, out, in]: per channel
            qs.append(q)
            scales.append(scale[..., None])
        return Fp8Experts(experts, in_f, out_f, stack=(layers,), source_dtype=source_dtype,
                          arrays=dict(q=jnp.stack(qs), scale=jnp.stack(scales)))
    parts = []
    for layer in range(layers):
        w = jnp.swapaxes(jnp.asarray(kernel[layer]), 1, 2)  # [E, out, in]: each expert in torch's layout
        parts.append(quantize_4bit_batch(w, quant_type=cfg.quant_type, blocksize=cfg.blocksize,
                                         double_quant=cfg.double_quant, nested_blocksize=cfg.nested_blocksize,
                                         nested_rounding=cfg.nested_rounding))
        del w
    arrays = {k: jnp.stack([p[k] for p in parts]) for k in parts[0]}
    return Quant4bitExperts(experts, in_f, out_f, stack=(layers,), quant_type=cfg.quant_type, blocksize=cfg.blocksize,
                            double_quant=cfg.double_quant, nested_blocksize=cfg.nested_blocksize,
                            source_dtype=source_dtype, arrays=arrays)


def stored_fp8_experts(stored: dict, source_dtype: str) -> dict[tuple[str, ...], Fp8Experts]:
    """{tree path: Fp8Experts} of an FP8 checkpoint's expert stacks as stored: `stored` maps each path to (codes
    [L, E, out, in] float8_e4m3fn, scales [L, E, out / bm, in / bn] float32) as `bridge.fp8.load_expert_rows`
    reads them (host arrays)."""
    out = {}
    for path, (q, scale) in stored.items():
        layers, experts, out_f, in_f = q.shape
        block = (out_f // scale.shape[-2], in_f // scale.shape[-1])
        out[path] = Fp8Experts(experts, in_f, out_f, stack=(layers,), block=block, source_dtype=source_dtype,
                               arrays=dict(q=jnp.asarray(q), scale=jnp.asarray(scale)))
    return out


def checkpoint_fp8_blocks(model, path) -> dict[tuple[str, ...], tuple[int, int]]:
    """{tree path: (bm, bn)} of the expert stacks the checkpoint at `path` stores per expert in FP8 (none for any
    other checkpoint), read from its config and headers alone (`bridge.fp8.expert_blocks`)."""
    if path is None:
        return {}
    suffix = fp8.scale_suffix(read_config(path), str(path))
    if suffix is None:
        return {}
    files = checkpoint_files(path)
    names = {n for f in files for n in read_header(f)[0]}
    stacks = layer_stacks(model.config)
    rows = fp8.expert_rows(family_for(model.config.model_type).table, names, suffix, stacks, model.config.num_layers)
    return fp8.expert_blocks(path, files, rows, stacks, model.config.num_layers, suffix)


def install_experts(model, site: ExpertSite, quant: QuantizedExperts) -> None:
    """Puts `quant` in place of the site's `ExpertParam` (the dense stack is gone from the model)."""
    setattr(site.holder(model), site.path[-1], nnx.data(quant))


def abstract_experts(model, cfg: QuantConfig | Fp8Config | None,
                     stored_blocks: dict[tuple[str, ...], tuple[int, int]] | None = None) -> None:
    """`install_experts` with zero arrays for every site `from_pretrained(quant_config=cfg)` would quantise
    (under `nnx.eval_shape`: shapes alone, for compiling before the weights are read). `stored_blocks` ({tree path:
    (bm, bn)}, `bridge.fp8.expert_blocks`): an FP8 checkpoint's expert stacks, which load as stored in FP8 where
    `cfg` is None or an `Fp8Config` that does not skip them."""
    stored_blocks = stored_blocks or {}
    for site in expert_sites(model):
        skipped = cfg is not None and any(is_skipped(n, cfg.skip_modules) for n in site.names())
        stored = site.path in stored_blocks and not skipped and not isinstance(cfg, QuantConfig)
        if not stored and (cfg is None or skipped):
            continue
        weight = getattr(site.holder(model), site.path[-1])
        *lead, experts, in_f, out_f = weight.shape
        if stored or isinstance(cfg, Fp8Config):
            quant = Fp8Experts(experts, in_f, out_f, stack=tuple(lead), block=stored_blocks.get(site.path),
                               source_dtype=str(model.dtype))
        else:
            quant = Quant4bitExperts(experts, in_f, out_f, stack=tuple(lead), quant_type=cfg.quant_type,
                                     blocksize=cfg.blocksize, double_quant=cfg.double_quant,
                                     nested_blocksize=cfg.nested_blocksize, source_dtype=str(model.dtype))
        install_experts(model, site, quant)


def quant_bytes(quant: QuantizedExperts) -> int:
    """Device bytes the quantised stack holds (codes and scales; 4 bits: absmax, nested absmax, offsets)."""
    return sum(math.prod(v.shape) * jnp.dtype(v.dtype).itemsize
               for _, v in nnx.to_flat_state(nnx.state(quant)))


def saved_expert_bytes(quant: QuantizedExperts, dtype) -> int:
    """Device bytes the quantised stack saves over the dense stack in `dtype`."""
    return math.prod(quant.shape) * jnp.dtype(dtype).itemsize - quant_bytes(quant)
