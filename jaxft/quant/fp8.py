"""Frozen linears as FP8 weights (`load_in_fp8`, `from_pretrained(quantize="fp8")`): which ones (every `Linear`
site `jaxft.quant.weights.linear_sites` finds, unless its HF name is in `Fp8Config.skip_modules`: the output head
and routers by default; embeddings and norms are no linears), quantised one layer at a time on the device.

A quantised `Linear` keeps its bias and LoRA slots; its `kernel` is replaced by `quant`, a `QuantFp8` module
whose variables are `Fp8Weight`s (`jaxft.models.layers`), told apart from trainable state by type, like the 4-bit
weights. A site is quantised for all layers of its stack. MoE expert stacks are stored in FP8 too
(`jaxft.quant.experts`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxft.models.layers import QuantFp8
from jaxft.quant.config import Fp8Config, is_skipped
from jaxft.quant.experts import abstract_experts, checkpoint_fp8_blocks
from jaxft.quant.weights import install, linear_sites
from kernels_pallas.fp8_matmul import OP, quantize_rows

__all__ = ["abstract_fp8", "program_options", "quantize_fp8_site", "quantize_linears_fp8", "saved_fp8_bytes"]

# A host kernel [in, out] as torch's [out, in] (one scale per output channel), transposed inside the program: an
# eager transpose and jnp.asarray each compiled a program per kernel shape.
_quantize = jax.jit(lambda kernel: quantize_rows(kernel.T))


def program_options(cfg, device) -> dict:
    """XLA options a training step over an FP8 base wants on `device`: where its frozen GEMMs are FP8 GEMMs
    (`xla_fp8`), XLA's Triton GEMMs off, so every f8 dot is a cuBLASLt FP8 call without autotuning Triton
    candidates for it (Llama-3.1-8B at 1 x 4096 on an H100: the step compiled in 131 s with them on, 69 s
    off). Empty elsewhere, or when `cfg` is not an `Fp8Config`."""
    if not isinstance(cfg, Fp8Config) or OP.resolve(cfg.implementation, device).name != "xla_fp8":
        return {}
    return {"xla_gpu_enable_triton_gemm": False}


def quantize_fp8_site(kernel: np.ndarray, stacked: bool, cfg: Fp8Config, axes=(None, None)) -> QuantFp8:
    """The FP8 module of a host kernel [L?, in, out] (the layout of `Linear.kernel`), quantised one layer at a
    time on the device (only one layer's weight exists there in the source dtype)."""
    in_f, out_f = kernel.shape[-2:]
    qs, scales = [], []
    for layer in ([kernel[i] for i in range(kernel.shape[0])] if stacked else [kernel]):
        q, scale = _quantize(layer)
        qs.append(q)
        scales.append(scale)
    arrays = dict(q=jnp.stack(qs), scale=jnp.stack(scales)) if stacked else dict(q=qs[0], scale=scales[0])
    return QuantFp8(out_f, in_f, stack=(len(qs),) if stacked else (), axes=axes, implementation=cfg.implementation,
                    arrays=arrays)


def saved_fp8_bytes(quant: QuantFp8, dtype) -> int:
    """Device bytes the FP8 form saves over the weight in `dtype`."""
    dense = math.prod(quant.q.shape) * jnp.dtype(dtype).itemsize
    return dense - math.prod(quant.q.shape) - math.prod(quant.scale.shape) * 4


def quantize_linears_fp8(model, arrays: dict, cfg: Fp8Config, verbose: bool = True) -> list[str]:
    """Installs an FP8 module in every linear site of `model` not skipped by name, from (and popping) its host
    kernel in `arrays` (tree path -> numpy array, as `bridge.load_weights` returns them); returns the HF names
    of the linears kept in the model dtype."""
    kept, done, saved = [], 0, 0
    for site in linear_sites(model):
        names = site.names()
        if any(is_skipped(n, cfg.skip_modules) for n in names):
            kept.extend(names)
            continue
        lin = site.linear(model)
        quant = quantize_fp8_site(arrays.pop((*site.path, "kernel")), site.stacked, cfg, lin.axes)
        install(lin, quant)
        done, saved = done + 1, saved + saved_fp8_bytes(quant, model.dtype)
    if verbose:
        templates = sorted({s.template for s in linear_sites(model) if s.linear(model).quant is None})
        print(f"jaxft: {done} linear module(s) in FP8 (e4m3, a scale per output channel), {saved / 2**20:.1f} MiB "
              f"saved over {model.dtype}; kept in {model.dtype}: {', '.join(templates) or 'none'}")
    return kept


def abstract_fp8(model, cfg: Fp8Config, path=None) -> None:
    """Installs the FP8 modules `from_pretrained(path, quant_config=cfg)` would, with zero arrays (call it under
    `nnx.eval_shape` for shapes alone): for ahead-of-time compilation before the weights are read. `path` (the
    checkpoint) gives an FP8 checkpoint's expert stacks their stored blocks; without it they are per channel."""
    abstract_experts(model, cfg, checkpoint_fp8_blocks(model, path))
    for site in linear_sites(model):
        if any(is_skipped(n, cfg.skip_modules) for n in site.names()):
            continue
        lin = site.linear(model)
        install(lin, QuantFp8(lin.out_features, lin.in_features, stack=(len(site.layers),) if site.stacked else (),
                              axes=lin.axes, implementation=cfg.implementation))
