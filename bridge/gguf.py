"""GGUF files (llama.cpp's format) out and in, through llama.cpp's own `gguf` package.

Out: `write_gguf` takes a transformers config dict and the transformers-named tensors (what `save_weights`
would write), renames them (`bridge.mappings.gguf`), applies llama.cpp's value changes (q/k rotary
interleave, Gemma's norm offset), quantises the matrices to the chosen GGML type and writes the metadata
llama.cpp and transformers' GGUF loader read: the architecture's sizes, RoPE (llama3's as llama.cpp's per-pair
`rope_freqs` tensor, which transformers' loader ignores and `read_config` turns back into its parameters), the tokenizer
(`tokenizer.ggml.*`) and the chat template.

In: `read_config` rebuilds the transformers config dict from the metadata, `read_tensors` dequantises every
tensor (gguf's `dequantize`) and undoes the value changes, giving transformers-named float32 arrays that
`tree_arrays` maps onto the tree with the family's name table.
"""

from __future__ import annotations

import functools
import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from bridge.errors import CheckpointError
from bridge.mappings import gguf as names
from bridge.mappings import transforms
from bridge.mappings.schema import LayerMap, Table, stack_layers

SUFFIX = ".gguf"
# save_gguf's dtype -> (GGML tensor type name, llama.cpp file type name). The gguf package can write these; its
# k-quants (q4_k, q6_k, ...) and i-quants it can only read.
WRITE_TYPES = {
    "f32": ("F32", "ALL_F32"),
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q5_1": ("Q5_1", "MOSTLY_Q5_1"),
    "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
}
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER, _TOKEN_UNUSED, _TOKEN_BYTE = 1, 2, 3, 4, 5, 6
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# transformers' GGUF tokenizer rebuilds these pre-tokenizer splits by name; other byte-level splits read as GPT-2's
_PRE_SPLITS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
}


def gguf_module():
    """The `gguf` package, or a CheckpointError saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise CheckpointError("GGUF files need llama.cpp's `gguf` package: pip install gguf") from None
    return gguf


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether `path` names a GGUF file (by its suffix: a model directory is never one)."""
    return Path(path).suffix.lower() == SUFFIX and not Path(path).is_dir()


def family_of(model_type: str, source: str) -> names.GgufFamily:
    try:
        return names.FAMILIES[model_type]
    except KeyError:
        raise CheckpointError(f"{source}: GGUF export/import supports model_type {', '.join(sorted(names.FAMILIES))}; "
                              f"{model_type!r} has no GGUF mapping in bridge/mappings/gguf.py") from None


def _tensor_map(fam: names.GgufFamily) -> list[tuple[re.Pattern, str, re.Pattern, str]]:
    """(HF regex, GGUF template, GGUF regex, HF template) per module and suffix: names both ways."""
    out = []
    for hf, gg in fam.modules:
        for suffix in (".weight", ".bias"):
            out.append((_pattern(hf + suffix), gg + suffix, _pattern(gg + suffix), hf + suffix))
    return out


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(?P<i>0|[1-9][0-9]*)"))


def _rename(name: str, pairs, to_gguf: bool) -> str | None:
    for hf_re, gg, gg_re, hf in pairs:
        m = (hf_re if to_gguf else gg_re).fullmatch(name)
        if m:
            return (gg if to_gguf else hf).format(**m.groupdict())
    return None


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation: each head's rows [first half, second half] -> pairs (x_j, x_{j+d/2})."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _deinterleave(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _value_change(hf_name: str, w: np.ndarray, fam: names.GgufFamily, config: Mapping, out: bool) -> np.ndarray:
    """llama.cpp's change of one tensor's values on the way out (`out`), or its inverse on the way in."""
    if fam.permute_qk and (".self_attn.q_proj." in hf_name or ".self_attn.k_proj." in hf_name):
        heads = config["num_attention_heads"] if ".q_proj." in hf_name else config["num_key_value_heads"]
        return (_interleave if out else _deinterleave)(w, int(heads))
    if fam.norm_offset and hf_name.endswith("norm.weight"):
        return w + np.float32(fam.norm_offset if out else -fam.norm_offset)
    return w


# --------------------------------------------------------------------------- metadata


def _rope_fields(config: Mapping, arch: str, source: str) -> dict[str, Any]:
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    params = params.get("full_attention", params)  # Gemma 3: the global layers' RoPE (the local one: freq_base_swa)
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope.freq_base": float(params.get("rope_theta", config.get("rope_theta", 10000.0)))}
    if kind == "linear":
        out.update({"rope.scaling.type": "linear", "rope.scaling.factor": float(params["factor"])})
    elif kind == "yarn":
        out.update({"rope.scaling.type": "yarn", "rope.scaling.factor": float(params["factor"]),
                    "rope.scaling.original_context_length": int(params["original_max_position_embeddings"]),
                    "rope.scaling.yarn_beta_fast": float(params.get("beta_fast", 32.0)),
                    "rope.scaling.yarn_beta_slow": float(params.get("beta_slow", 1.0))})
        if params.get("attention_factor") is not None:
            out["rope.scaling.attn_factor"] = float(params["attention_factor"])
    elif kind == "llama3":
        if arch != "llama":
            raise CheckpointError(f"{source}: llama3 RoPE is a rope_freqs tensor that llama.cpp applies to its llama "
                                  f"architecture only, not {arch!r}; GGUF export supports default, linear and yarn "
                                  "RoPE there")
        # Not read by llama.cpp outside YaRN; jaxft reads it back as the original_max_position_embeddings
        out["rope.scaling.original_context_length"] = int(params["original_max_position_embeddings"])
    elif kind != "default":
        raise CheckpointError(f"{source}: RoPE type {kind!r} has no GGUF metadata that transformers and jaxft read "
                              "back; GGUF export supports default, linear, yarn and (llama) llama3 RoPE")
    return out


ROPE_FREQS = "rope_freqs.weight"
# a llama.cpp file carries no original context length with its rope_freqs: its own converter's default
LLAMA3_CONTEXT = 8192


def _rotary_wavelengths(head_dim: int, theta: float) -> np.ndarray:
    return 2 * np.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def llama3_rope_factors(params: Mapping[str, Any], head_dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs` tensor for llama3 RoPE: per rotary pair, the divisor of its frequency. Pairs whose
    wavelength is under original_max_position_embeddings / high_freq_factor keep theirs (1), those over
    original_max_position_embeddings / low_freq_factor are divided by `factor`, those between blend the two
    linearly in 1 / wavelength, as transformers' llama3 RoPE does."""
    wavelength = _rotary_wavelengths(head_dim, float(params["rope_theta"]))
    factor = float(params["factor"])
    low, high = float(params.get("low_freq_factor", 1.0)), float(params.get("high_freq_factor", 4.0))
    smooth = np.clip((float(params["original_max_position_embeddings"]) / wavelength - low) / (high - low), 0, 1)
    return (1 / ((1 - smooth) / factor + smooth)).astype(np.float32)


def _llama3_from_factors(factors: np.ndarray, head_dim: int, theta: float, context: int,
                         source: str) -> dict[str, Any]:
    """The llama3 RoPE parameters whose `llama3_rope_factors` are `factors`. Only context / low_freq_factor and
    context / high_freq_factor shape them, so `context` (the file's original context length) fixes the two
    factors; they come from a line fit of the blended pairs, which needs two of them."""
    f = np.asarray(factors, np.float64)
    factor = float(f.max())
    blended = (f > 1 + 1e-5) & (f < factor * (1 - 1e-5))
    wrong = CheckpointError(f"{source}: tensor {ROPE_FREQS} is not a llama3 RoPE scaling jaxft can recover "
                            f"(factors {np.round(f, 4).tolist()}); load the Hugging Face checkpoint")
    if f.shape != (head_dim // 2,) or f.min() < 1 - 1e-5 or blended.sum() < 2:
        raise wrong
    smooth = (1 / f[blended] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(context / _rotary_wavelengths(head_dim, theta)[blended], smooth, 1)
    low = -intercept / slope
    params = {"rope_type": "llama3", "rope_theta": theta, "factor": float(f"{factor:.6g}"),
              "low_freq_factor": float(f"{low:.6g}"), "high_freq_factor": float(f"{low + 1 / slope:.6g}"),
              "original_max_position_embeddings": int(context)}
    if not np.allclose(llama3_rope_factors(params, head_dim), f, rtol=1e-4, atol=0):
        raise wrong
    return params


def _metadata(config: Mapping, fam: names.GgufFamily, source: str) -> dict[str, Any]:
    """{GGUF key after `<arch>.`: value} for a transformers config dict."""
    out: dict[str, Any] = {}
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    config = {**config, "head_dim": head_dim, "num_key_value_heads": config.get("num_key_value_heads")
              or config["num_attention_heads"]}
    for hf_key, key in names.CONFIG_KEYS + fam.extra_keys:
        if config.get(hf_key) is not None:
            out[key] = config[hf_key]
    _check_layer_pattern(config, fam, source)
    if fam.rope_dimension_is_head_dim:
        out["rope.dimension_count"] = head_dim
    out.update(_rope_fields(config, fam.arch, source))
    if fam.norm_offset:  # Gemma: the query scale when it is not head_dim ** -0.5
        scalar = config.get("query_pre_attn_scalar")
        if scalar is not None and scalar != head_dim:
            out["attention.scale"] = float(scalar) ** -0.5
        sliding = (config.get("rope_parameters") or {}).get("sliding_attention", {})
        local = sliding.get("rope_theta", config.get("rope_local_base_freq"))
        if local is not None:
            out["rope.freq_base_swa"] = float(local)
    return out


def _check_layer_pattern(config: Mapping, fam: names.GgufFamily, source: str) -> None:
    """GGUF has no per-layer attention kinds: llama.cpp assumes the architecture's pattern (Gemma 2 alternating,
    Gemma 3 five sliding to one full) and no window elsewhere, so a model that differs is refused, not changed."""
    types = config.get("layer_types")
    n = int(config["num_hidden_layers"])
    if fam.arch in ("gemma2", "gemma3"):
        every = 2 if fam.arch == "gemma2" else 6
        default = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        if types is not None and list(types) != default:
            raise CheckpointError(f"{source}: layer_types {types} is not {fam.arch}'s fixed pattern in llama.cpp; "
                                  "GGUF cannot carry it, export a Hugging Face checkpoint (save_pretrained)")
    elif config.get("use_sliding_window") or (types is not None and "sliding_attention" in types):
        raise CheckpointError(f"{source}: sliding-window layers (use_sliding_window / layer_types) have no GGUF "
                              f"metadata for {fam.arch}; export a Hugging Face checkpoint (save_pretrained)")


def _config_from_metadata(fields: Mapping[str, Any], tensor_names: set[str], source: str,
                          rope_freqs: np.ndarray | None = None) -> dict[str, Any]:
    arch = fields.get("general.architecture")
    model_type = names.model_type_of(arch, fields)
    if model_type is None:
        archs = sorted({f.arch for f in names.FAMILIES.values()})
        raise CheckpointError(f"{source}: GGUF architecture {arch!r} is not one jaxft loads ({', '.join(archs)}); "
                              "convert the model's Hugging Face checkpoint instead")
    fam = names.FAMILIES[model_type]
    prefix = arch + "."
    config: dict[str, Any] = {"model_type": model_type}
    for hf_key, key in names.CONFIG_KEYS + fam.extra_keys:
        if prefix + key in fields:
            config[hf_key] = fields[prefix + key]
    if "head_dim" not in config and prefix + "rope.dimension_count" in fields and fam.rope_dimension_is_head_dim:
        config["head_dim"] = fields[prefix + "rope.dimension_count"]
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in fields:
        config["vocab_size"] = len(fields["tokenizer.ggml.tokens"])
    missing = [k for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                           "vocab_size") if k not in config]
    if missing:
        raise CheckpointError(f"{source}: GGUF metadata lacks {', '.join(missing)} ({prefix}* keys); the file is "
                              "incomplete")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(fields.get(prefix + "rope.freq_base", 1e4))}
    kind = fields.get(prefix + "rope.scaling.type", "none")
    if ROPE_FREQS in tensor_names:  # llama3 RoPE (Llama 3.1+), as llama.cpp stores it
        if rope_freqs is None or model_type not in ("llama", "mistral") or kind != "none":
            raise CheckpointError(f"{source}: tensor {ROPE_FREQS} (llama3 RoPE) is read for a llama file without "
                                  f"other RoPE scaling, not {arch!r} with scaling {kind!r}; load the Hugging Face "
                                  "checkpoint")
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        context = fields.get(prefix + "rope.scaling.original_context_length", LLAMA3_CONTEXT)
        rope = _llama3_from_factors(rope_freqs, int(head_dim), rope["rope_theta"], int(context), source)
    elif kind == "linear":
        rope.update(rope_type="linear", factor=float(fields[prefix + "rope.scaling.factor"]))
    elif kind == "yarn":
        rope.update(rope_type="yarn", factor=float(fields[prefix + "rope.scaling.factor"]),
                    original_max_position_embeddings=int(fields[prefix + "rope.scaling.original_context_length"]),
                    beta_fast=float(fields.get(prefix + "rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(fields.get(prefix + "rope.scaling.yarn_beta_slow", 1.0)))
        if prefix + "rope.scaling.attn_factor" in fields:
            rope["attention_factor"] = float(fields[prefix + "rope.scaling.attn_factor"])
    elif kind != "none":
        raise CheckpointError(f"{source}: GGUF RoPE scaling {kind!r} is not supported (none, linear, yarn)")
    config["rope_parameters"] = rope
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    if model_type in ("llama", "mistral"):
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        config["mlp_bias"] = "blk.0.ffn_gate.bias" in tensor_names
    if model_type == "qwen3":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if fam.norm_offset:
        config["hidden_activation"] = "gelu_pytorch_tanh"
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        scale = fields.get(prefix + "attention.scale")
        config["query_pre_attn_scalar"] = head_dim if scale is None else round(float(scale) ** -2, 4)
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        if prefix + "rope.freq_base_swa" in fields:
            config["rope_local_base_freq"] = float(fields[prefix + "rope.freq_base_swa"])
    for hf_key, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("pad_token_id", "padding_token_id")):
        if "tokenizer.ggml." + key in fields:
            config[hf_key] = int(fields["tokenizer.ggml." + key])
    return config


def _fields(reader) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, float):  # stored as float32: the shortest decimal that rounds to it (1e-06, not 9.99e-07)
            value = float(str(np.float32(value)))
        out[key] = value
    return out


def _reader(path: Path):
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    stat = path.stat()
    return _parsed(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _parsed(path: str, mtime_ns: int, size: int):
    """One parse per file version: the reader walks every vocabulary string in Python (~8 s for a 49k-token
    vocabulary on a slow core), and a load reads the metadata and then the tensors."""
    gguf = gguf_module()
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError / struct.error / KeyError on a damaged file
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The transformers config dict a GGUF file's metadata describes."""
    path = Path(path)
    reader = _reader(path)
    freqs = next((np.asarray(t.data, np.float32) for t in reader.tensors
                  if t.name == ROPE_FREQS and t.tensor_type == gguf_module().GGMLQuantizationType.F32), None)
    return _config_from_metadata(_fields(reader), {t.name for t in reader.tensors}, str(path), freqs)


def read_tensors(path: str | os.PathLike, config: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """{transformers tensor name: float32 array} of a GGUF file, dequantised, llama.cpp's value changes undone."""
    gguf = gguf_module()
    path = Path(path)
    reader = _reader(path)
    fam = family_of(config["model_type"], str(path))
    pairs = _tensor_map(fam)
    out = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:  # llama3 RoPE's factors: read into the config (`read_config`)
            continue
        hf_name = _rename(t.name, pairs, to_gguf=False)
        if hf_name is None:
            raise CheckpointError(f"{path}: tensor {t.name!r} has no {config['model_type']} counterpart "
                                  "(bridge/mappings/gguf.py); the file is of another architecture")
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise CheckpointError(f"{path}: tensor {t.name} is {t.tensor_type.name}, which the gguf package cannot "
                                  "dequantise; use a file in F16/BF16/Q8_0/Q4_K or another type it reads") from None
        out[hf_name] = _value_change(hf_name, np.asarray(w, np.float32), fam, config, out=False)
    return out


def tree_arrays(table: Table, expected: Mapping[tuple, Any], tensors: Mapping[str, np.ndarray], num_layers: int,
                dtype: Any, *, layer_map: LayerMap | None = None, source: str = "") -> dict[tuple, np.ndarray]:
    """{tree path: array in `dtype`} from transformers-named tensors, through the family's name table (the
    dense families: no expert or vision rows). Missing, mis-shaped or unused tensors are one CheckpointError."""
    out, used, missing, misshaped = {}, set(), [], []
    for row in table:
        if row.path not in expected:
            continue
        shape = tuple(expected[row.path].shape)
        arr = out.setdefault(row.path, np.empty(shape, dtype))
        layers = stack_layers(row, layer_map, num_layers)
        sizes = {"i": len(layers) if layers is not None else num_layers}
        for index in row.indices(sizes):
            name = row.name_at(index, layers)
            if name not in tensors:
                missing.append(name)
                continue
            used.add(name)
            dst = arr[index]
            if row.part is not None:
                dst = dst[..., row.part_slice(dst.shape[-1])]
            value = transforms.to_ours(row.transform, tensors[name])
            if value.shape != dst.shape:
                misshaped.append(f"{name}: {list(value.shape)}, expected {list(dst.shape)}")
                continue
            dst[...] = value
    unused = sorted(set(tensors) - used - ({"lm_head.weight"} if ("lm_head", "kernel") not in expected else set()))
    problems = [f"{what}: {', '.join(items[:5])}" for what, items in
                (("missing", missing), ("wrong shape", misshaped), ("not used by the model", unused)) if items]
    if problems:
        raise CheckpointError(f"{source}: the GGUF tensors do not match the model described by its metadata; "
                              + "; ".join(problems))
    return out


# --------------------------------------------------------------------------- tokenizer


def _tokenizer_fields(tokenizer, vocab_size: int, source: str) -> dict[str, Any]:
    """tokenizer.ggml.* and the chat template from a transformers fast tokenizer (byte-level BPE -> llama.cpp's
    `gpt2` model; BPE with byte fallback, SentencePiece's form -> `llama`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise CheckpointError(f"{source}: GGUF export needs a fast (tokenizers) tokenizer, got "
                              f"{type(tokenizer).__name__}")
    spec = json.loads(backend.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise CheckpointError(f"{source}: GGUF export writes BPE tokenizers (byte-level or byte-fallback); this one "
                              f"is {model.get('type')}")
    spm = bool(model.get("byte_fallback"))
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    by_id = {i: tok for tok, i in model["vocab"].items()}
    by_id.update({i: t["content"] for i, t in added.items()})
    if max(by_id) >= vocab_size:
        raise CheckpointError(f"{source}: the tokenizer has ids up to {max(by_id)} but the model's vocabulary is "
                              f"{vocab_size}")
    tokens, types, scores = [], [], []
    for i in range(vocab_size):
        tok = by_id.get(i)
        if tok is None:  # the embedding's padding rows: llama.cpp needs one token per row
            tokens.append(f"[PAD{i}]")
            types.append(_TOKEN_UNUSED)
        elif i == getattr(tokenizer, "unk_token_id", None):
            tokens.append(tok)
            types.append(_TOKEN_UNKNOWN)
        elif i in added:
            tokens.append(tok)
            types.append(_TOKEN_CONTROL if added[i].get("special") else _TOKEN_USER)
        else:
            tokens.append(tok)
            types.append(_TOKEN_BYTE if spm and _BYTE_TOKEN.fullmatch(tok) else _TOKEN_NORMAL)
        scores.append(0.0 if types[-1] != _TOKEN_NORMAL else -float(i))  # SentencePiece BPE: merge rank order
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    out: dict[str, Any] = {"tokenizer.ggml.model": "llama" if spm else "gpt2", "tokenizer.ggml.tokens": tokens,
                           "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
    if spm:
        out["tokenizer.ggml.scores"] = scores
        out["tokenizer.ggml.add_space_prefix"] = _adds_prefix_space(spec)
    else:
        out["tokenizer.ggml.pre"] = _pre_name(spec.get("pre_tokenizer"))
    for key, attr in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("unknown_token_id", "unk_token_id"), ("padding_token_id", "pad_token_id")):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            out["tokenizer.ggml." + key] = int(value)
    ids = tokenizer("a")["input_ids"]
    bos, eos = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)
    out["tokenizer.ggml.add_bos_token"] = bos is not None and len(ids) > 1 and ids[0] == bos
    out["tokenizer.ggml.add_eos_token"] = eos is not None and len(ids) > 1 and ids[-1] == eos
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        out["tokenizer.chat_template"] = template
    return out


def _adds_prefix_space(spec: Mapping) -> bool:
    text = json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")])
    return any(f'"prepend_scheme": "{s}"' in text for s in ("always", "first")) or '"Prepend"' in text


def _pre_name(pre: Mapping | None) -> str:
    """llama.cpp's pre-tokenizer name for a byte-level split (what transformers' GGUF tokenizer rebuilds)."""
    for step in (pre or {}).get("pretokenizers", [pre or {}]):
        regex = (step.get("pattern") or {}).get("Regex") if step.get("type") == "Split" else None
        if regex in _PRE_SPLITS:
            return _PRE_SPLITS[regex]
    return "gpt-2"


# --------------------------------------------------------------------------- writing


def _ggml_tensor(gguf, w: np.ndarray, qtype, f16_type):
    """(data, raw type) of one tensor: vectors stay F32 as llama.cpp keeps them; a matrix whose rows do not split
    into the type's blocks falls back to F16, as llama.cpp's converter does."""
    if w.ndim < 2 or qtype == gguf.GGMLQuantizationType.F32:
        return w.astype(np.float32), gguf.GGMLQuantizationType.F32
    if qtype == gguf.GGMLQuantizationType.F16:
        return w.astype(np.float16), qtype
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if w.shape[-1] % block:
        return w.astype(np.float16), f16_type
    return gguf.quants.quantize(np.ascontiguousarray(w, np.float32), qtype), qtype


def write_gguf(path: str | os.PathLike, config: Mapping[str, Any], tensors: Iterable[tuple[str, np.ndarray]], *,
               dtype: str = "f16", tokenizer=None, name: str | None = None, overwrite: bool = False) -> Path:
    """Writes one GGUF file from a transformers config dict and its named tensors ([out, in] matrices).

    `dtype` is the GGML type of the matrices (`WRITE_TYPES`); vectors (norms, biases) are float32. `tokenizer`
    (a transformers fast tokenizer) adds the vocabulary, merges, special ids and chat template llama.cpp needs;
    without one the file holds the weights and architecture only. Written to a temp file and renamed into place;
    an existing file is refused unless `overwrite`."""
    gguf = gguf_module()
    path = Path(path)
    source = str(path)
    if dtype not in WRITE_TYPES:
        raise CheckpointError(f"GGUF dtype {dtype!r} is not one the gguf package writes; choose one of "
                              f"{', '.join(WRITE_TYPES)}")
    if path.exists() and not overwrite:
        raise CheckpointError(f"{path} exists; pass overwrite=True to replace it")
    fam = family_of(config.get("model_type"), source)
    qtype = gguf.GGMLQuantizationType[WRITE_TYPES[dtype][0]]
    metadata = _metadata(config, fam, source)
    pairs = _tensor_map(fam)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, fam.arch)
        # not the bare model_type: transformers reads a `llama` file named "mistral" as a Mistral it cannot map
        writer.add_name(name or (config.get("architectures") or [config["model_type"]])[0])
        writer.add_file_type(int(gguf.LlamaFileType[WRITE_TYPES[dtype][1]]))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, value in metadata.items():
            _add(writer, f"{fam.arch}.{key}", value)
        if tokenizer is not None:
            for key, value in _tokenizer_fields(tokenizer, int(config["vocab_size"]), source).items():
                _add(writer, key, value)
        for hf_name, w in tensors:
            gg = _rename(hf_name, pairs, to_gguf=True)
            if gg is None:
                raise CheckpointError(f"{source}: tensor {hf_name} has no GGUF name for {config['model_type']} "
                                      "(bridge/mappings/gguf.py)")
            w = _value_change(hf_name, np.asarray(w, np.float32), fam, config, out=True)
            data, raw = _ggml_tensor(gguf, w, qtype, gguf.GGMLQuantizationType.F16)
            writer.add_tensor(gg, data, raw_dtype=raw)
        rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
        if rope.get("rope_type", rope.get("type")) == "llama3":
            head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
            theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
            writer.add_tensor(ROPE_FREQS, llama3_rope_factors({**rope, "rope_theta": theta}, int(head_dim)),
                              raw_dtype=gguf.GGMLQuantizationType.F32)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _add(writer, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif key == "tokenizer.ggml.token_type":
        writer.add_array(key, [int(v) for v in value])  # gguf stores an int list as int32, as llama.cpp reads it
    else:
        writer.add_array(key, list(value))
