"""Compiles the training step of a Llama-3.1-8B-shaped model on an FP8 frozen base (`examples/bench/fp8.yaml` or
`fp8_lean.yaml`) from shapes alone (a config.json, no weights: `jaxft.run.Run.compile` before `load`) and counts
the FP8 GEMMs of the optimized HLO: on a GPU with FP8 tensor cores, cuBLASLt's `__cublas$lt$matmul$f8` calls (the
forward and the input gradient of each frozen linear and layer), or, with XLA's Triton GEMMs on (its default; the
recipes do not turn them off), Triton GEMM fusions on f8 operands where autotuning found those faster; on the CPU
(`--implementation xla_fp8`, a dry run of the script) the converts to f8e4m3fn.

    python experiments/fp8_hlo.py                                   # the GPU: 8B, 32 layers, 1 x 4096 tokens
    python experiments/fp8_hlo.py --recipe examples/bench/fp8_lean.yaml --dump /tmp/fp8_lean_hlo.txt
    python experiments/fp8_hlo.py --no-triton-gemm                  # every f8 dot a cuBLASLt call
    python experiments/fp8_hlo.py --layers 2 --hidden 256 --implementation xla_fp8 --seq 256   # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxft.quant import Fp8Config
from jaxft.run import Run
from jaxft.train.config_file import load_config

REPO = Path(__file__).resolve().parents[1]
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "attention_bias": False,
    "mlp_bias": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "use_cache": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}
F8_GEMM = re.compile(r'custom_call_target="__cublas\$lt\$matmul\$f8"')
TO_F8 = re.compile(r"= f8e4m3fn\[[\d,]+\]\S* convert\(")
TRITON_F8 = re.compile(r"\n%gemm_fusion\S*_computation \([\w.]+: f8e4m3fn\[[\d,]+\], [\w.]+: f8e4m3fn\[")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(REPO / "examples" / "bench" / "fp8.yaml"))
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=None, help="a smaller width (head_dim 128, MLP 3.5x)")
    ap.add_argument("--implementation", default="auto", help="the fp8_matmul implementation (Fp8Config)")
    ap.add_argument("--dump", default=None, help="write the optimized HLO text here")
    ap.add_argument("--no-triton-gemm", action="store_true",
                    help="compile with xla_gpu_enable_triton_gemm off: every f8 dot a cuBLASLt call")
    args = ap.parse_args()

    shape = dict(LLAMA_8B, num_hidden_layers=args.layers)
    if args.hidden:
        shape.update(hidden_size=args.hidden, intermediate_size=args.hidden * 7 // 2,
                     num_attention_heads=args.hidden // 128, num_key_value_heads=max(1, args.hidden // 512))
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(shape))
        cfg = load_config(args.recipe, [f"model_name_or_path={model_dir}", f"max_seq_length={args.seq}",
                                        f"dataset={REPO / 'examples' / 'data' / 'train.jsonl'}"]
                          + (["compiler_options={xla_gpu_enable_triton_gemm: false}"] if args.no_triton_gemm else []))
        if not isinstance(cfg.quant_config, Fp8Config):
            raise SystemExit(f"{args.recipe}: load_in_fp8 is not true; use examples/bench/fp8.yaml or fp8_lean.yaml")
        run = Run.from_config(cfg, 1)
        run.quant_config = Fp8Config(skip_modules=cfg.quant_config.skip_modules, implementation=args.implementation)
        rows = cfg.data.per_device_train_batch_size * cfg.optim.gradient_accumulation_steps
        ids = np.ones((rows, args.seq), np.int32)
        batch = dict(input_ids=ids, targets=ids, loss_mask=ids.astype(np.float32), segment_ids=ids,
                     positions=np.tile(np.arange(args.seq, dtype=np.int32), (rows, 1)))
        began = time.perf_counter()
        compiled = run.compile(batch)
        text = compiled.as_text()
    if args.dump:
        Path(args.dump).write_text(text)
    stats = compiled.memory_analysis()
    print(f"{args.recipe}: {args.layers} layers, {rows} x {args.seq} tokens, {run.layer_loop}, compiled in "
          f"{time.perf_counter() - began:.0f} s; temp {stats.temp_size_in_bytes / 2**30:.2f} GiB, arguments "
          f"{stats.argument_size_in_bytes / 2**30:.2f} GiB")
    print(f"FP8 GEMMs: cuBLASLt (__cublas$lt$matmul$f8) {len(F8_GEMM.findall(text))}, Triton GEMM fusions on f8 "
          f"operands {len(TRITON_F8.findall(text))} "
          f"(expected per layer, {'unrolled' if run.unrolled else 'in the scan body'}: 7 input gradients and 4 to 7 "
          f"forward ones, XLA's dot merger may join q/k/v and gate/up); converts to f8e4m3fn: "
          f"{len(TO_F8.findall(text))}")


if __name__ == "__main__":
    main()
