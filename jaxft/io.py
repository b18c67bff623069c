"""Hugging Face checkpoints in and out: `from_pretrained` and `save_pretrained`.

The file formats live in `bridge` (which knows nothing of our modules); this module turns a bridge parameter
dict (tree path -> numpy array) into an NNX model and back. Loading never builds a random model first: the
model is created abstractly (`nnx.eval_shape`) and filled tensor by tensor, so peak host memory stays close
to one copy of the weights.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import bridge
from bridge import bnb4bit, fp8, gguf, mxfp4
from bridge.safetensors_io import PendingTensor, read_header
from jaxft.config import ModelConfig
from jaxft.data.formatting import load_tokenizer
from jaxft.families import family_for
from jaxft.lora import merged_kernels
from jaxft.models.build import abstract_model
from jaxft.models.decoder import Decoder
from jaxft.models.layers import LoraParam, TokenRows, linears
from jaxft.models.quant_experts import QuantizedExperts
from jaxft.models.stack import layer_stacks
from jaxft.quant import experts as qe, fp8 as qf, weights as qw
from jaxft.quant.config import Fp8Config, is_skipped
from jaxft.sharding import MeshConfig, Placement

logger = logging.getLogger("jaxft")


def _vision_blocks(cfg: ModelConfig) -> int | None:
    """The vision tower's depth (the count of the table's {v} rows), None for a text-only model."""
    return None if cfg.vision is None else cfg.vision.depth


def _checkpoint_table(family, path: Path):
    """The family's name table, or one of its other `layouts` when the checkpoint holds more of that one's
    (unindexed) tensor names; ties go to the family's table, and the load reports what does not match."""
    if not family.layouts:
        return family.table

    names = {n for f in bridge.checkpoint_files(path) for n in read_header(f)[0]}
    tables = (family.table, *family.layouts)
    hits = [sum(row.hf in names for row in table if not row.axes) for table in tables]
    return tables[hits.index(max(hits))]


def _path_key(path) -> tuple[str, ...]:
    return tuple(str(p) for p in path)


def param_shapes(model: Decoder) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """Tree path -> shape/dtype of every base parameter (LoRA and trained token rows excluded; a table trained in
    full is the base parameter it replaces)."""
    state = nnx.state(model, nnx.Not(nnx.Any(LoraParam, TokenRows)))
    out = {}
    for path, var in nnx.to_flat_state(state):
        if isinstance(var, nnx.Param):
            out[_path_key(path)] = jax.ShapeDtypeStruct(var.shape, var.dtype)
    return out


GENERATION_CONFIG = "generation_config.json"


def read_generation_config(model_dir: str | os.PathLike) -> str | None:
    """The text of a model directory's generation_config.json (stop ids and decoding defaults that config.json
    may not hold, e.g. an instruct model's end-of-turn id), or None where it has none."""
    file = Path(model_dir) / GENERATION_CONFIG
    return file.read_text(encoding="utf-8") if file.is_file() else None


def from_pretrained(path: str | os.PathLike, dtype: str = "bfloat16", quantize: str | None = None, *,
                    double_quant: bool = True, quant_config=None, verbose: bool = True, mesh=None) -> Decoder:
    """Loads an HF model directory (config.json + safetensors) into a jaxft `Decoder` in `dtype`.

    quantize="nf4" / "fp4" (or `quant_config=jaxft.quant.QuantConfig(...)`) stores the frozen linears in
    bitsandbytes' 4-bit format, quantised one layer at a time on the device from the host copy, so the whole
    model never exists in `dtype` on the accelerator; modules named in `QuantConfig.skip_modules` or over its
    `max_rel_error` stay in `dtype` (listed, with the memory saved, when `verbose`). quantize="fp8" (or
    `quant_config=jaxft.quant.Fp8Config(...)`) stores them and the MoE expert stacks in FP8 instead
    (`jaxft.quant.fp8`, `jaxft.quant.experts`), quantised the same way, never unless asked. A bitsandbytes 4-bit
    checkpoint (config.json `quantization_config`) loads as stored, byte for byte; an MXFP4 checkpoint (GPT-OSS)
    has its expert weights decoded to `dtype` (`bridge.mxfp4`), an FP8 one (transformers' fine-grained or
    compressed-tensors) its linear weights (`bridge.fp8`), while its per-expert FP8 weights load as stored, codes
    and block scales (dequantised only where `quant_config` is 4-bit or skips the experts by name).

    A `.gguf` file (llama.cpp) loads as a base model too, every tensor dequantised to `dtype` (`bridge.gguf`;
    the dense families, not with `mesh`).

    `mesh` (a `jaxft.sharding.Placement` or `MeshConfig`): every weight is built sharded by the rules
    (`jax.make_array_from_callback`), each device's shard read from the safetensors slices it holds, so no
    host or device ever holds a whole (sharded) weight. Not with 4-bit weights yet.

    The directory's generation_config.json is kept with the model (`generation_config`) for `save_pretrained`.
    """
    path = Path(path)
    hf = bridge.read_config(path)
    source = str(path) if gguf.is_gguf(path) else str(path / "config.json")
    cfg = ModelConfig.from_hf(hf, source=source)
    dtype = jnp.dtype(dtype)
    if gguf.is_gguf(path):
        return _from_gguf(path, hf, cfg, dtype, quant_config or (
            None if quantize is None else Fp8Config() if quantize == "fp8"
            else qw.QuantConfig(quant_type=quantize, double_quant=double_quant)),
            verbose, mesh)
    fp8_scale = fp8.scale_suffix(hf, source)
    # MXFP4 (experts) and FP8 checkpoints (linears): decoded below
    stored = None if mxfp4.is_mxfp4(hf) or fp8_scale else bnb4bit.quantization_config(hf, source)
    if quant_config is None and quantize == "fp8":
        quant_config = Fp8Config()
    elif quant_config is None and quantize is not None:
        quant_config = qw.QuantConfig(quant_type=quantize, double_quant=double_quant)
    to_fp8 = isinstance(quant_config, Fp8Config)
    if stored is not None and quant_config is not None:
        raise ValueError(f"{source}: the checkpoint is already bitsandbytes 4-bit; load it without quantize= / "
                         "quant_config= (it loads as stored)")
    model = abstract_model(cfg, dtype=dtype)
    table = _checkpoint_table(family_for(cfg.model_type), path)
    expected = param_shapes(model)
    mx_shapes = {}
    if mxfp4.is_mxfp4(hf):
        if quant_config is not None:
            raise ValueError(f"{source}: the checkpoint's experts are MXFP4 (decoded to {dtype} on load); load it "
                             "without quantize= / quant_config=")
        names = {n for f in bridge.checkpoint_files(path) for n in read_header(f)[0]}
        rows = mxfp4.quantized_rows(table, names)
        if not rows:
            raise bridge.CheckpointError(f"{source}: quantization_config.quant_method is 'mxfp4' but no tensor is "
                                         "stored as <name>_blocks / <name>_scales; remove quantization_config")
        mx_shapes = {row.path: expected.pop(row.path).shape for row in rows}
    fp8_shapes, expert_shapes = {}, {}
    if fp8_scale:
        names = {n for f in bridge.checkpoint_files(path) for n in read_header(f)[0]}
        fp8_rows = [row for row in fp8.quantized_rows(table, names, fp8_scale, layer_stacks(cfg), cfg.num_layers)
                    if row.path in expected]
        fp8_experts = fp8.expert_rows(table, names, fp8_scale, layer_stacks(cfg), cfg.num_layers)
        if not fp8_rows and not fp8_experts:
            raise bridge.CheckpointError(f"{source}: quantization_config says FP8 but no linear weight has a "
                                         f"<module>.{fp8_scale} beside it; remove quantization_config")
        fp8_shapes = {row.path: expected.pop(row.path).shape for row in fp8_rows}
        # the experts' codes and scales are read as stored (below); the gate and up rows share one path
        expert_shapes = {p: expected.pop(p).shape for p in dict.fromkeys(row.path for row in fp8_experts)}
    if mesh is not None:
        if fp8_shapes or expert_shapes:
            raise ValueError(f"{source}: loading an FP8 checkpoint sharded over a mesh is not supported yet; load "
                             "without mesh=, save_pretrained it and load that sharded")
        if mx_shapes:
            raise ValueError(f"{source}: loading an MXFP4 checkpoint sharded over a mesh is not supported yet; load "
                             "without mesh=, save_pretrained it (bf16) and load that sharded")
        if stored is not None or quant_config is not None:
            raise ValueError(f"{source}: loading 4-bit weights sharded over a mesh is not supported yet; load "
                             "without mesh= (one device), or without quantisation")
        return _with_generation_config(_sharded(model, path, cfg, expected, dtype, mesh, table), path)
    sites = qw.linear_sites(model)
    quants: dict = {}  # site -> (Quant4bit, True per layer in 4 bits)
    mixed: dict = {}  # site -> the shape of its dense rows (a module 4-bit in some layers only)
    ignore: set[str] = set()
    if stored is not None:
        records = bnb4bit.read_quantized(path, bridge.checkpoint_files(path))
        by_name = {n: (site, i) for site in sites for i, n in enumerate(site.names())}
        stray = sorted(set(records) - set(by_name))
        if stray:
            raise bridge.CheckpointError(
                f"{path}: 4-bit weights for modules that are not linear layers of this {cfg.model_type} model: "
                f"{stray[:3]}; re-quantise with them in llm_int8_skip_modules")
        for site in sites:
            names = site.names()
            present = [n for n in names if n in records]
            if not present:
                continue
            # A module 4-bit in some layers only (a per-layer llm_int8_skip_modules): its dense rows are read
            # apart (`_dense_rows`), the rest of the load expects no kernel for it.
            four = tuple(n in records for n in names)
            quants[site] = (qw.site_from_records([records[n] for n in present], site.stacked, f"{path}: {present[0]}"),
                            four)
            ignore.update(t for n in present for t in bnb4bit.tensor_names(n, records[n]))
            kernel = expected.pop((*site.path, "kernel"))
            if not all(four):
                mixed[site] = jax.ShapeDtypeStruct((four.count(False), *kernel.shape[1:]), kernel.dtype)
                ignore.update(n + ".weight" for n, f in zip(names, four) if not f)
        quant_config = qw.QuantConfig.from_hf(stored)
    if mx_shapes:
        ignore.update(n for row in rows for n in mxfp4.tensor_names(row, cfg.num_layers))
    if fp8_shapes:
        ignore.update(fp8.tensor_names(fp8_rows, cfg.num_layers, names, fp8_scale, layer_stacks(cfg)))
    if expert_shapes:
        ignore.update(fp8.expert_tensor_names(fp8_experts, layer_stacks(cfg), cfg.num_layers, cfg.num_experts, names,
                                              fp8_scale))
    arrays = bridge.load_weights(path, table, expected, cfg.num_layers, dtype,
                                 num_experts=cfg.num_experts or None, ignore=ignore, layer_map=layer_stacks(cfg),
                                 num_vision_blocks=_vision_blocks(cfg))
    for site, shape in mixed.items():
        arrays[(*site.path, "kernel")] = _dense_rows(path, table, cfg, dtype, site, quants[site][1], shape)
    if mx_shapes:
        arrays.update(mxfp4.load_rows(path, bridge.checkpoint_files(path), rows, mx_shapes, cfg.num_layers, dtype))
    if fp8_shapes:
        arrays.update(fp8.load_rows(path, bridge.checkpoint_files(path), fp8_rows, fp8_shapes, cfg.num_layers,
                                    dtype, fp8_scale, layer_stacks(cfg)))
    if expert_shapes:
        _stored_fp8_experts(model, fp8.load_expert_rows(path, bridge.checkpoint_files(path), fp8_experts,
                                                        expert_shapes, layer_stacks(cfg), cfg.num_layers,
                                                        cfg.num_experts, fp8_scale),
                            arrays, quant_config, dtype, verbose)
    skipped: list[str] = []
    if to_fp8:
        skipped = qf.quantize_linears_fp8(model, arrays, quant_config, verbose)
    elif stored is None and quant_config is not None:
        skipped = _quantize_sites(model, sites, arrays, quant_config, quants, str(dtype), verbose)
    elif stored is not None:  # the HF names of the dense linears, layer by layer
        skipped = [n for s in sites if s not in quants for n in s.names()]
        skipped += [n for s, (_, four) in quants.items() for n, f in zip(s.names(), four) if not f]
    for site, (quant, four) in quants.items():
        qw.install(site.linear(model), quant, four)
    if stored is None and quant_config is not None:
        _quantize_experts(model, arrays, quant_config, str(dtype), verbose)
    return _filled(model, arrays, quant_config, skipped, path)


def _stored_fp8_experts(model, stored: dict, arrays: dict, quant_config, dtype, verbose: bool) -> None:
    """An FP8 checkpoint's expert stacks (`stored`: path -> (codes, scales), `bridge.fp8.load_expert_rows`): kept
    in FP8 as stored, unless the load stores experts otherwise (a 4-bit `quant_config`, or an `Fp8Config` whose
    skip_modules names them): then dequantised into `arrays` as dense kernels for that."""
    sites = {site.path: site for site in qe.expert_sites(model)}
    kept = {}
    for key, (codes, scales) in stored.items():
        skipped = quant_config is not None and any(is_skipped(n, quant_config.skip_modules)
                                                   for n in sites[key].names())
        if quant_config is None or (isinstance(quant_config, Fp8Config) and not skipped):
            kept[key] = (codes, scales)
        else:
            arrays[key] = fp8.dequantize_experts(codes, scales, dtype)
    for key, quant in qe.stored_fp8_experts(kept, str(dtype)).items():
        qe.install_experts(model, sites[key], quant)
        if verbose:
            bm, bn = quant.block
            print(f"jaxft: {sites[key].param} in FP8 as stored (e4m3, a scale per {bm} x {bn} block), "
                  f"{qe.saved_expert_bytes(quant, model.dtype) / 2**20:.1f} MiB saved over {model.dtype}")


def _dense_rows(path: Path, table, cfg: ModelConfig, dtype, site, four: tuple[bool, ...],
                shape: jax.ShapeDtypeStruct) -> np.ndarray:
    """The dense layers' rows [n, in, out] of a module 4-bit in its other layers (True in `four`): a load of that
    one kernel, the stack mapped to those layers alone, every other tensor of the checkpoint ignored."""
    key = (*site.path, "kernel")
    layers = tuple(layer for layer, f in zip(site.layers, four) if not f)
    wanted = {n + ".weight" for n, f in zip(site.names(), four) if not f}
    others = {n for f in bridge.checkpoint_files(path) for n in read_header(f)[0]} - wanted
    return bridge.load_weights(path, table, {key: shape}, cfg.num_layers, dtype, ignore=others,
                               layer_map={site.path[0]: layers})[key]


def _filled(model: Decoder, arrays: dict, quant_config, skipped, path: Path) -> Decoder:
    """The abstract `model` with its parameters set from host `arrays` (emptied as they move)."""
    graphdef, state = nnx.split(model)
    flat = nnx.to_flat_state(state)
    leaves, finite = [], []
    for p, var in flat:
        key = _path_key(p)
        if key in arrays:
            # pop + wait: the host copy is released as soon as the device copy exists (peak ~ one copy plus
            # the largest tensor); without the wait the runtime keeps the host buffer alive until later.
            host = arrays.pop(key)
            value = jax.device_put(host).block_until_ready()
            if jnp.issubdtype(value.dtype, jnp.inexact):
                finite.append((key, np.isfinite(host).all() if _host_checked(host, value) else _all_finite(value)))
            del host
            var = var.replace(value)
        leaves.append((p, var))
    _warn_non_finite(path, finite)
    model = nnx.merge(graphdef, nnx.from_flat_state(leaves))
    if quant_config is not None:
        model.quant_config = quant_config
        model.quant_skipped = tuple(skipped)
    return _with_generation_config(model, path)


def _with_generation_config(model: Decoder, path: Path) -> Decoder:
    model.generation_config = read_generation_config(path)  # for save_pretrained
    return model


def _host_checked(host, value: jax.Array) -> bool:
    """Small weights are checked on the host copy: the device check compiles one program per shape (~0.1 s on a
    CPU each), which would dominate loading a small model; large ones stay on the device (fused, no host pass)."""
    return isinstance(host, np.ndarray) and host.dtype == value.dtype and host.size <= 1 << 20


@jax.jit
def _all_finite(x: jax.Array) -> jax.Array:
    return jnp.isfinite(x).all()  # fused: no boolean copy of the weight


def _warn_non_finite(path: Path, finite: list[tuple[tuple[str, ...], jax.Array]]) -> None:
    """One warning naming the weights that hold NaN or infinite values (read in one sync after the loads): a
    model that computes NaN from its first step otherwise trains and exports NaN without a word."""
    bad = [".".join(key) for (key, _), ok in zip(finite, jax.device_get([f for _, f in finite])) if not ok]
    if bad:
        logger.warning("%s: %d weight(s) hold NaN or infinite values: %s%s; the model's outputs will be NaN", path,
                       len(bad), ", ".join(bad[:5]), ", ..." if len(bad) > 5 else "")


def _from_gguf(path: Path, hf: dict, cfg: ModelConfig, dtype, quant_config, verbose: bool, mesh) -> Decoder:
    """`from_pretrained` of a GGUF file: dequantised tensors through the family's table, then as a dense load."""
    if mesh is not None:
        raise ValueError(f"{path}: loading a GGUF file sharded over a mesh is not supported; load without mesh=, "
                         "save_pretrained it and load that directory sharded")
    model = abstract_model(cfg, dtype=dtype)
    expected = param_shapes(model)
    tensors = gguf.read_tensors(path, hf)
    arrays = gguf.tree_arrays(family_for(cfg.model_type).table, expected, tensors, cfg.num_layers, dtype,
                              layer_map=layer_stacks(cfg), source=str(path))
    del tensors
    skipped: list[str] = []
    if isinstance(quant_config, Fp8Config):
        skipped = qf.quantize_linears_fp8(model, arrays, quant_config, verbose)
    elif quant_config is not None:
        sites = qw.linear_sites(model)
        quants: dict = {}
        skipped = _quantize_sites(model, sites, arrays, quant_config, quants, str(dtype), verbose)
        for site, (quant, four) in quants.items():
            qw.install(site.linear(model), quant, four)
    return _filled(model, arrays, quant_config, skipped, path)


def _quantize_sites(model, sites, arrays, qcfg, quants, dtype_name, verbose) -> list[str]:
    """Quantises every site (into `quants` as (Quant4bit, True per layer in 4 bits)), layer by layer: a layer
    stays in the model dtype when its HF name is skipped or its error exceeds `max_rel_error`, so a module may be
    4-bit in some layers only (its host kernel keeps those rows; popped when none). Returns the HF names of the
    linears kept in the model dtype, layer by layer; `verbose` prints each with why and what it costs."""
    kept, lines, saved, cost = [], [], 0, 0
    for site in sites:
        names = site.names()
        by_name = [qw.is_skipped(n, qcfg.skip_modules) for n in names]
        key = (*site.path, "kernel")
        if all(by_name):
            kept.extend(names)
            lines.append(f"  {site.template}: by name (skip_modules)")
            continue
        quant, four, errors = qw.quantize_site(arrays[key], site.stacked, qcfg, dtype_name, by_name)
        dense = [i for i, f in enumerate(four) if not f]
        kept.extend(names[i] for i in dense)
        lin = site.linear(model)
        each = qw.layer_saving(lin.out_features, lin.in_features, qcfg, model.dtype)
        cost += each * sum(1 for i in dense if errors[i] is not None)
        named = [i for i in dense if errors[i] is None]
        over = [i for i in dense if errors[i] is not None]

        def which(rows):  # the module, or the layers of it
            every = len(rows) == len(names) or not site.stacked
            return site.template + ("" if every else f" in layers {[site.layers[i] for i in rows]}")

        if named:
            lines.append(f"  {which(named)}: by name (skip_modules)")
        if over:
            worst = max(errors[i] for i in over)
            lines.append(f"  {which(over)}: relative error {worst:.4f} > max_rel_error {qcfg.max_rel_error} "
                         f"({each * len(over) / 2**20:.2f} MiB more than in 4 bits)")
        if quant is None:
            continue
        if dense:
            arrays[key] = arrays[key][np.asarray(dense)]  # the dense rows alone
        else:
            del arrays[key]
        quants[site] = (quant, four)
        saved += qw.saved_bytes(quant, model.dtype)
    if verbose:
        print(f"jaxft: {len(quants)} linear module(s) in 4-bit {qcfg.quant_type} "
              f"({'double-quantised absmax, ' if qcfg.double_quant else ''}blocks of {qcfg.blocksize}), "
              f"{saved / 2**20:.1f} MiB saved over {model.dtype}"
              + (f", less {cost / 2**20:.2f} MiB for the layers kept dense over max_rel_error" if cost else "")
              + f"; kept in {model.dtype}:" + ("\n" + "\n".join(lines) if lines else " none"))
    return kept


def _quantize_experts(model, arrays, qcfg, dtype_name, verbose) -> None:
    """Stores every MoE expert stack not skipped by name in 4 bits or FP8 (`qcfg`, `jaxft.quant.experts`),
    popping its host copy; prints what it saved."""
    done, kept, saved = 0, [], 0
    for site in qe.expert_sites(model):
        if any(is_skipped(n, qcfg.skip_modules) for n in site.names()):
            kept.append(site.param)
            continue
        quant = qe.quantize_experts(arrays.pop(site.path), qcfg, dtype_name)
        qe.install_experts(model, site, quant)
        done, saved = done + 1, saved + qe.saved_expert_bytes(quant, model.dtype)
    if verbose and (done or kept):
        what = ("FP8 (e4m3, a scale per output channel)" if isinstance(qcfg, Fp8Config)
                else f"4-bit {qcfg.quant_type}")
        print(f"jaxft: {done} expert stack(s) in {what}, {saved / 2**20:.1f} MiB saved over "
              f"{model.dtype}" + (f"; kept in {model.dtype} (skip_modules): {', '.join(kept)}" if kept else ""))


def model_params(model: Decoder, *, merge_lora: bool = True, dequantize: bool = True
                 ) -> dict[tuple[str, ...], np.ndarray]:
    """Base parameters as host arrays, with LoRA deltas merged into the kernels when present, and the 4-bit
    linears' kernels dequantised in the model dtype (left out with dequantize=False); quantised expert stacks
    (4-bit, FP8) are dequantised in the model dtype either way."""
    merged = merged_kernels(model) if merge_lora else {}
    out = {}
    for p, lin in linears(model):
        key = (*p.split("."), "kernel")
        if lin.quant is not None and key not in merged and dequantize:
            out[key] = np.asarray(lin.frozen_kernel(model.dtype))
    for p, node in nnx.iter_graph(model):
        key = _path_key(p)
        # Quantised experts are always written dense: a bitsandbytes checkpoint has no 4-bit expert format.
        if isinstance(node, QuantizedExperts) and key not in merged:
            out[key] = np.asarray(node.dequantize(model.dtype))
    for key in list(param_shapes(model)) + [k for k in merged if k not in out]:
        if key in out:
            continue
        if key in merged:
            out[key] = np.asarray(merged[key])
            continue
        node = model
        for part in key:
            node = getattr(node, part)
        out[key] = np.asarray(node[...])
    return out


def save_pretrained(model: Decoder, path: str | os.PathLike, *, dtype: str | None = None,
                    max_shard_bytes: int = 5 * 1024**3, overwrite: bool = False, quantized: bool = False,
                    generation_config: str | None = None) -> Path:
    """Writes an HF directory (config.json + sharded safetensors + index); LoRA adapters are merged, and 4-bit
    linears are dequantised (a merged export is dense).

    generation_config.json goes along: `generation_config` (its text), else the one of the directory the model
    was loaded from (`from_pretrained`); without it transformers would stop the merged model only on
    config.json's eos id and at its default length, where the base stops on every id the file lists.

    quantized=True writes a 4-bit model in bitsandbytes' format instead (what transformers saves and loads with
    `quantization_config`; the linears kept in the model dtype listed as llm_int8_skip_modules); a model with
    LoRA adapters is refused there (merging would need re-quantising: save the adapter with save_adapter).
    The directory is written atomically (a temp dir renamed into place). An existing non-empty `path` is
    refused unless `overwrite=True`, which replaces it whole."""
    cfg: ModelConfig = model.config
    hf = cfg.to_hf()
    out_dtype = jnp.dtype(dtype) if dtype else model.dtype
    hf["dtype"] = str(out_dtype)
    table = family_for(cfg.model_type).table
    extra = []
    if quantized:
        qcfg = getattr(model, "quant_config", None)
        if isinstance(qcfg, Fp8Config):
            raise ValueError("save_pretrained(quantized=True): the model's base is FP8, which has no bitsandbytes "
                             "format; save it with quantized=False (dequantised to the model dtype)")
        if qcfg is None:
            raise ValueError("save_pretrained(quantized=True): the model has no 4-bit linears; load it with "
                             "jaxft.from_pretrained(path, quantize='nf4')")
        if any(lin.has_lora for _, lin in linears(model)):
            raise ValueError("save_pretrained(quantized=True): the model has LoRA adapters, which a 4-bit base "
                             "cannot absorb without re-quantising; save them with jaxft.save_adapter, or export a "
                             "merged dense model with quantized=False")
        params = {k: v.astype(out_dtype) for k, v in model_params(model, merge_lora=False, dequantize=False).items()}
        for site in qw.linear_sites(model):
            lin = site.linear(model)
            if lin.quant is None:
                continue
            four = qw.four_bit_rows(lin, len(site.names()))
            names = [n for n, f in zip(site.names(), four) if f]
            for name, record in zip(names, qw.records_of(lin.quant, site.stacked)):
                extra.extend(bnb4bit.tensors_of(name, record))
            if lin.quant_rows is not None:  # a mixed module: its dense rows under their layers' names
                dense = {(*site.path, "kernel"): params.pop((*site.path, "kernel"))}
                layers = tuple(layer for layer, f in zip(site.layers, four) if not f)
                for name, value in bridge.hf_tensors(table, dense, cfg.num_layers, layer_map={site.path[0]: layers}):
                    value = np.ascontiguousarray(value)
                    extra.append(PendingTensor(name, tuple(value.shape), value.dtype, lambda v=value: v))
        hf["quantization_config"] = qcfg.to_hf(str(model.dtype), model.quant_skipped)
    else:
        hf.pop("quantization_config", None)  # from a 4-bit source's config.json: the export is dense
        params = {k: v.astype(out_dtype) for k, v in model_params(model).items()}
    generation = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    bridge.save_weights(path, table, params, cfg.num_layers, hf, max_shard_bytes=max_shard_bytes,
                        overwrite=overwrite, num_experts=cfg.num_experts or None, extra=extra,
                        layer_map=layer_stacks(cfg), num_vision_blocks=_vision_blocks(cfg),
                        files={GENERATION_CONFIG: generation} if generation is not None else {})
    return Path(path)


def _sharded(model: Decoder, path: Path, cfg: ModelConfig, expected, dtype, mesh, table) -> Decoder:
    placement = Placement(mesh) if isinstance(mesh, MeshConfig) else mesh
    graphdef, state = nnx.split(model)
    leaves = []
    with bridge.WeightSlices(path, table, expected, cfg.num_layers, dtype, num_experts=cfg.num_experts or None,
                             layer_map=layer_stacks(cfg), num_vision_blocks=_vision_blocks(cfg)) as source:
        for p, var in nnx.to_flat_state(state):
            key = _path_key(p)
            if key in expected:
                read = lambda index, key=key: source.read(key, index)  # noqa: E731  (one shard, on demand)
                value = jax.make_array_from_callback(var.shape, placement.sharding_of(var), read)
                var = var.replace(value.block_until_ready())
            leaves.append((p, var))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def save_gguf(model: Decoder, path: str | os.PathLike, dtype: str = "f16", *, tokenizer=None,
              overwrite: bool = False) -> Path:
    """Writes the model as one GGUF file (llama.cpp, Ollama, LM Studio; transformers reads it with
    `gguf_file=`): LoRA adapters merged and 4-bit linears dequantised as in `save_pretrained`, the matrices in
    `dtype` ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0"; norms and biases stay float32).

    `tokenizer` (a transformers fast tokenizer, or the path of a model directory / GGUF file holding one) adds
    the vocabulary, merges, special token ids and chat template a runtime needs to talk to the model; without it
    the file holds the weights and architecture only. Dense families (llama, mistral, qwen2, qwen3, gemma2,
    gemma3_text)."""
    cfg: ModelConfig = model.config
    hf = cfg.to_hf()
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    table = family_for(cfg.model_type).table
    tensors = bridge.hf_tensors(table, model_params(model), cfg.num_layers, layer_map=layer_stacks(cfg))
    return gguf.write_gguf(path, hf, tensors, dtype=dtype, tokenizer=tokenizer, overwrite=overwrite)
