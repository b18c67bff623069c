"""Peak host memory of bridge.load_weights on a Llama-3.2-1B-shaped checkpoint.

Writes a random bf16 checkpoint with Llama-3.2-1B shapes (hidden 2048,
intermediate 8192, 16 layers, 32 heads / 8 kv heads, vocab 128256, tied
embeddings; ~2.47 GB) as several safetensors shards, then loads it in a fresh
subprocess with ``load_weights(..., dtype=bfloat16)`` and compares that
process's peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``, and ``/usr/bin/time
-v``'s "Maximum resident set size" when available) with the checkpoint size.

Done criterion: peak RSS <= 1.5 x checkpoint bytes. The result itself is one
checkpoint's worth, so the criterion leaves 0.5x for the interpreter, numpy,
the scratch buffer and any transient copy.

Usage: python -m experiments.probes.measure_load_rss [--dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parents[1]

from bridge import load_weights, read_config, table_for  # noqa: E402

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "dtype": "bfloat16",
}
SHARD_BYTES = 1_000_000_000


def hf_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names and [out, in] shapes of the checkpoint."""
    h, i, v, d = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    nq, nkv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq, h),
            p + "self_attn.k_proj.weight": (nkv, h),
            p + "self_attn.v_proj.weight": (nkv, h),
            p + "self_attn.o_proj.weight": (h, nq),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    return shapes


def expected_tree(c: dict) -> dict[tuple, tuple]:
    """Tree paths/shapes the model has (what jaxft would pass as `expected`)."""
    h, i, v, d, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"], c["num_hidden_layers"]
    nq, nkv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    bf16 = np.dtype(ml_dtypes.bfloat16)
    shapes = {
        ("embed", "embedding"): (v, h),
        ("final_norm", "scale"): (h,),
        ("layers", "input_norm", "scale"): (n, h),
        ("layers", "post_attn_norm", "scale"): (n, h),
        ("layers", "attn", "q_proj", "kernel"): (n, h, nq),
        ("layers", "attn", "k_proj", "kernel"): (n, h, nkv),
        ("layers", "attn", "v_proj", "kernel"): (n, h, nkv),
        ("layers", "attn", "o_proj", "kernel"): (n, nq, h),
        ("layers", "mlp", "gate_proj", "kernel"): (n, h, i),
        ("layers", "mlp", "up_proj", "kernel"): (n, h, i),
        ("layers", "mlp", "down_proj", "kernel"): (n, i, h),
    }
    return {p: (s, bf16) for p, s in shapes.items()}


def random_bf16(shape, rng) -> np.ndarray:
    # Random sign and mantissa, exponent in [2^-7, 2): finite values without an fp32 temporary.
    raw = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    return ((raw & 0x83FF) | 0x3C00).view(ml_dtypes.bfloat16)


def write_checkpoint(directory: Path) -> int:
    rng = np.random.default_rng(0)
    shapes = hf_shapes(CONFIG)
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 2
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    n = len(groups)
    weight_map = {}
    for k, names in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        # One shard in memory at a time (<= SHARD_BYTES).
        save_file({name: random_bf16(shapes[name], rng) for name in names}, directory / fname, metadata={"format": "pt"})
        weight_map |= {name: fname for name in names}
    total = sum(int(np.prod(s)) * 2 for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))
    return n


def child(directory: Path, through_jaxft: bool) -> None:
    """Runs in a fresh process: load and report peak RSS as JSON on stdout."""
    if through_jaxft:
        import jax  # noqa: F401  (imported before the baseline so its own footprint is not counted as loading)

        import jaxft
    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    config = read_config(directory)
    t0 = time.perf_counter()
    if through_jaxft:
        # The whole user path: config -> abstract model -> streamed tensors -> jax arrays in the NNX model.
        model = jaxft.from_pretrained(directory, dtype="bfloat16")
        out = {("layers", "attn", "q_proj", "kernel"): np.asarray(model.layers.attn.q_proj.kernel[...])}
        out["_all"] = np.zeros(0)
        result_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx_state(model)))
    else:
        out = load_weights(directory, table_for(config["model_type"]), expected_tree(config),
                           config["num_hidden_layers"], "bfloat16")
    seconds = time.perf_counter() - t0
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if not through_jaxft:
        result_bytes = sum(a.nbytes for a in out.values())
    # Spot check after the measurement: layer 5 q_proj equals the file's tensor, transposed.
    spot = _file_tensor(directory, "model.layers.5.self_attn.q_proj.weight")
    assert np.array_equal(out[("layers", "attn", "q_proj", "kernel")][5].view(np.uint16), spot.T.view(np.uint16))
    print(json.dumps({"baseline_rss": base_kb * 1024, "peak_rss": peak_kb * 1024,
                      "result_bytes": result_bytes, "load_seconds": seconds}))


def nnx_state(model):
    from flax import nnx

    return nnx.state(model)


def _file_tensor(directory: Path, name: str) -> np.ndarray:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    file = directory / index["weight_map"][name]
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(n))[name]
    begin, end = entry["data_offsets"]
    mm = np.memmap(file, dtype=np.uint16, mode="r", offset=8 + n + begin, shape=((end - begin) // 2,))
    return np.array(mm).reshape(entry["shape"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, help="where to write the checkpoint (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    parser.add_argument("--jaxft", action="store_true",
                        help="load through jaxft.from_pretrained (the user path) instead of bridge.load_weights")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.jaxft)
        return 0

    directory = args.dir or Path(tempfile.mkdtemp(prefix="jaxft-rss-"))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        n_shards = write_checkpoint(directory)
        ckpt_bytes = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
        print(f"wrote {n_shards} shards, {ckpt_bytes / 1e9:.3f} GB in {time.perf_counter() - t0:.1f}s -> {directory}")

        cmd = [sys.executable, "-m", "experiments.probes.measure_load_rss", "--child", str(directory)] + (
            ["--jaxft"] if args.jaxft else [])
        use_time = Path("/usr/bin/time").exists()
        proc = subprocess.run((["/usr/bin/time", "-v"] if use_time else []) + cmd,
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(proc.stdout, proc.stderr, file=sys.stderr)
            return proc.returncode
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        peak = report["peak_rss"]
        print(f"result arrays     : {report['result_bytes'] / 1e9:.3f} GB (load took {report['load_seconds']:.1f}s)")
        print(f"RSS after imports : {report['baseline_rss'] / 1e9:.3f} GB")
        print(f"peak RSS (getrusage): {peak / 1e9:.3f} GB = {peak / ckpt_bytes:.3f} x checkpoint")
        if use_time:
            m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
            if m:
                tv = int(m.group(1)) * 1024
                print(f"peak RSS (/usr/bin/time -v): {tv / 1e9:.3f} GB = {tv / ckpt_bytes:.3f} x checkpoint")
        ok = peak <= 1.5 * ckpt_bytes
        print(f"criterion peak <= 1.5 x checkpoint: {'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
