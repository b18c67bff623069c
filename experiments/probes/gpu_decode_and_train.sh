#!/usr/bin/env bash
# One device call for the numbers of the honest-metrics/generation issue, on random-weight bf16 models:
#   1. decode tokens/s, jaxft.generate vs transformers' generate (experiments/probes/bench_generate.py):
#      Llama-3.2-1B and Llama-3.1-8B shapes, batch 1 and 16, 128-token prompts, 256 new tokens;
#   2. what `jaxft-train` logs (tokens/s, step time, peak memory, compile time, summary) for the benchmark's
#      fast recipe (examples/bench/fast.yaml) on the 8B shape, packed 4096-token rows of ~300-token documents.
# Usage (device tool, repo root):  OUT=$OUT bash experiments/probes/gpu_decode_and_train.sh    (SHAPES=1b,8b STEPS=30)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the results folder}
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=2
W=${WORKDIR:-/tmp/jaxft_models}
mkdir -p "$W" "$OUT"
stamp() { echo "[gpu $(date +%T)] $*"; }
stamp "decode benchmark"
timeout "${DECODE_TIMEOUT_S:-330}" python3 -m experiments.probes.bench_generate --shapes "${SHAPES:-1b,8b}" \
  --workdir "$W" --out "$OUT/bench_generate.json" 2>&1 | tee "$OUT/generate.log" | tail -20
stamp "jaxft-train, 8B shape, examples/bench/fast.yaml, packed 4096-token rows"
python3 - "$W/docs.jsonl" <<'PY'
import json, random, sys
rng = random.Random(0)  # word-level tokenizer of scripts/bench/models.py: one token per "t<i>" word
with open(sys.argv[1], "w") as f:
    for _ in range(3000):
        f.write(json.dumps({"text": " ".join(f"t{rng.randrange(4, 1000)}" for _ in range(rng.randint(200, 400)))}) + "\n")
PY
start=$(date +%s%N)
timeout "${TRAIN_TIMEOUT_S:-240}" python3 -m jaxft.cli examples/bench/fast.yaml model_name_or_path="$W/llama-3.1-8b" \
  dataset="$W/docs.jsonl" output_dir="$W/run8b" max_steps="${STEPS:-30}" logging_steps=5 disable_tqdm=true \
  overwrite_output_dir=true 2>&1 | tee "$OUT/train_8b.log" | tail -25
echo "process wall time: $(( ($(date +%s%N) - start) / 1000000 )) ms" | tee -a "$OUT/train_8b.log"
cp "$W/run8b/metrics.jsonl" "$OUT/train_8b_metrics.jsonl" 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/train_8b.log"
