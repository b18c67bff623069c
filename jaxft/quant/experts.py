"""MoE expert stacks in 4 bits with `load_in_4bit`: which ones (every `ExpertParam` of the model, unless its HF
name is in `QuantConfig.skip_modules`), their quantisation one layer at a time on the device, and their bytes.

Each layer's experts of one projection, [E, in, out] in our layout, are quantised as E torch-layout [out, in]
matrices in one vmapped program (`jaxft.quant.blockwise.quantize_4bit_batch`): expert e's bytes are those of
`bitsandbytes.functional.quantize_4bit(W_e.T)`. transformers keeps MoE experts as 3-D `nn.Parameter`s (not
`nn.Linear`), so a bitsandbytes checkpoint never holds 4-bit experts: there is no record format to read or
write, and a 4-bit export writes them dequantised (`jaxft.io.save_pretrained`).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from bridge.mappings.schema import LAYER
from jaxft.families import family_for
from jaxft.models.layers import ExpertParam
from jaxft.models.quant_experts import Quant4bitExperts
from jaxft.models.stack import layer_stacks
from jaxft.quant.blockwise import quantize_4bit_batch
from jaxft.quant.config import QuantConfig, is_skipped

__all__ = ["ExpertSite", "expert_sites", "install_experts", "quantize_experts", "saved_expert_bytes"]


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


def quantize_experts(kernel: np.ndarray, cfg: QuantConfig, source_dtype: str) -> Quant4bitExperts:
    """The 4-bit stack of a host expert kernel [L, E, in, out], one layer on the device at a time."""
    layers, experts, in_f, out_f = kernel.shape
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


def install_experts(model, site: ExpertSite, quant: Quant4bitExperts) -> None:
    """Puts `quant` in place of the site's `ExpertParam` (the dense stack is gone from the model)."""
    setattr(site.holder(model), site.path[-1], nnx.data(quant))


def abstract_experts(model, cfg: QuantConfig | None) -> None:
    """`install_experts` with zero arrays for every site `from_pretrained(quant_config=cfg)` would quantise
    (under `nnx.eval_shape`: shapes alone, for compiling before the weights are read)."""
    if cfg is None:
        return
    for site in expert_sites(model):
        if any(is_skipped(n, cfg.skip_modules) for n in site.names()):
            continue
        weight = getattr(site.holder(model), site.path[-1])
        *lead, experts, in_f, out_f = weight.shape
        install_experts(model, site, Quant4bitExperts(
            experts, in_f, out_f, stack=tuple(lead), quant_type=cfg.quant_type, blocksize=cfg.blocksize,
            double_quant=cfg.double_quant, nested_blocksize=cfg.nested_blocksize, source_dtype=str(model.dtype)))


def quant_bytes(quant: Quant4bitExperts) -> int:
    """Device bytes the 4-bit stack holds (codes, absmax, nested absmax, offsets)."""
    return sum(math.prod(v.shape) * jnp.dtype(v.dtype).itemsize
               for v in (quant.packed, quant.absmax, quant.nested_absmax, quant.offset) if v is not None)


def saved_expert_bytes(quant: Quant4bitExperts, dtype) -> int:
    """Device bytes the 4-bit stack saves over the dense stack in `dtype`."""
    return math.prod(quant.shape) * jnp.dtype(dtype).itemsize - quant_bytes(quant)
