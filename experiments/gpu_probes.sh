#!/usr/bin/env bash
# The lab's device probes, one device call (the product's GPU check is scripts/gpu_check.sh). Each phase runs a
# module of experiments/ from the repo root; results go under $OUT (at most 8 files come back). PHASES names them
# (no default):
#   "forward" the foundation forward check (Llama-3.2-1B shape, bf16 vs fp32, every attention implementation):
#   $OUT/forward.json; "attention" the attention benchmark: $OUT/attention.json (ATTN_BUDGET_S=140);
#   "offload" the host-offload probe: $OUT/offload_probe.jsonl; OFFLOAD_DUMP=variant,... adds $OUT/offload_dump.tgz;
#   "maxctx" the longest 8B row per remat policy + one real step at 256k: $OUT/max_context.{jsonl,md},
#   MAXCTX_TIMEOUT_S=360;
#   "probe" the fetch forms a layer loop could read its weights from pinned host memory with, timed (PROBE_ARGS,
#   PROBE_TIMEOUT_S=150): $OUT/probe.json;
#   "overlap" copy/compute overlap of the host offload from a profile: $OUT/offload_overlap.json and
#   $OUT/overlap_trace.json.gz, OVERLAP_TIMEOUT_S=150;
#   "scaling" 8B LoRA on 1-8 GPUs, data parallel and FSDP, jaxft beside HF+PEFT under accelerate (SCALING_SYSTEMS,
#   default jaxft,hf_ckpt): $OUT/scaling.{json,md}, SCALING_TIMEOUT_S=560 (the JSON is rewritten after each point);
#   "70b" Llama-3.1-70B-shaped LoRA, FSDP over 8 GPUs (random weights made sharded): $OUT/scaling_70b.{json,md},
#   SCALING_70B_TIMEOUT_S=560;
#   "gmm" the MoE grouped-matmul benchmark (xla ragged_dot / pallas_mosaic / dense): $OUT/gmm.json,
#   GMM_TIMEOUT_S=200; "gmmsweep" its tile sweep (GMM_SWEEP_ARGS, e.g. "--table-variants --shapes
#   qwen3_30b_a3b_down"): $OUT/gmm_sweep.json; "gmmprobe" the forward row kernel on derived problems
#   (GMM_PROBE_ARGS): $OUT/gmm_probe.json.
# Usage (device tool, repo root):  OUT=$OUT PHASES="offload maxctx" bash experiments/gpu_probes.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the results folder}
PHASES=${PHASES:?name the probes to run, e.g. PHASES="forward attention"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=2
has() { [[ " $PHASES " == *" $1 "* ]]; }
stamp() { echo "[gpu_probes $(date +%T)] $*"; }

if has forward; then
  stamp "forward check (Llama-3.2-1B shape, bf16 vs fp32, every attention implementation)"
  timeout "${FORWARD_TIMEOUT_S:-150}" python3 -m experiments.probes.gpu_forward_check --out "$OUT/forward.json" \
    2>&1 | tail -20
fi

if has attention; then
  stamp "attention benchmark"
  timeout "${ATTN_TIMEOUT_S:-180}" python3 -m experiments.probes.bench_attention --out "$OUT/attention.json" \
    --time-budget-s "${ATTN_BUDGET_S:-140}" 2>&1 | tail -30
fi

if has offload; then
  # Host-offloaded remat: copies in the compiled HLO, temp and real peaks per policy / loop / attention / transfer
  # (one JSON line per variant; experiments/probes/offload_probe.py says what is counted). About 2-3 minutes on an H200.
  stamp "offload probe (remat none/full/offload/offload_explicit x scan/unroll, mini + 4-layer 1B-width recipe)"
  # OFFLOAD_DUMP="mini/offload,jaxft/offload_explicit/unroll" also dumps those variants' HLO (before/after XLA's
  # passes, the host-offload passes, buffer assignment) into $OUT/offload_dump.tgz.
  dump=()
  [ -n "${OFFLOAD_DUMP:-}" ] && dump=(--dump /tmp/offload_dump --dump-only "$OFFLOAD_DUMP")
  timeout "${OFFLOAD_TIMEOUT_S:-300}" python3 -m experiments.probes.offload_probe --out "$OUT/offload_probe.jsonl" \
    "${dump[@]}" ${OFFLOAD_ARGS:-} 2>&1 | tee -a "$OUT/check.log" | grep "^#"
  [ -d /tmp/offload_dump ] && tar czf "$OUT/offload_dump.tgz" -C /tmp offload_dump
fi

if has maxctx; then
  # Compile-only searches (one process per policy, no weights on the device) beside one real step at 262144 tokens
  # (random weights); everything ends by MAXCTX_TIMEOUT_S (the step alone is ~4-5 minutes: compile + ~170 s step).
  # MAXCTX_ARGS passes more options (e.g. "--step-seq 0", "--policies offload,full", "--host-memory-gb 128").
  stamp "max context (8B shape, batch 1, every remat policy; compiled memory + host accounting; one real step)"
  XLA_PYTHON_CLIENT_MEM_FRACTION=${MAXCTX_MEM_FRACTION:-0.95} timeout $(( ${MAXCTX_TIMEOUT_S:-360} + 60 )) \
    python3 -m experiments.probes.max_context --deadline-s "${MAXCTX_TIMEOUT_S:-360}" --out "$OUT/max_context.jsonl" \
    --md "$OUT/max_context.md" ${MAXCTX_ARGS:-} 2>&1 | grep -v '^{"event": "probe"' | tail -40 | tee -a "$OUT/check.log"
fi

if has probe; then
  stamp "stream fetch probe"
  timeout "${PROBE_TIMEOUT_S:-150}" python3 -m experiments.probes.stream_fetch_probe --out "$OUT/probe.json" \
    ${PROBE_ARGS:---layers 16 --tokens 16384} 2>&1 | tee -a "$OUT/check.log" | tail -10
fi

if has overlap; then
  # A profile of 3 steps of 4 layers of the 8B width, 1 x 8192: full vs offload (policy transfer in the scan,
  # explicit transfer unrolled); per-layer backward, copy time, copy/compute overlap, copy streams.
  stamp "offload overlap (profiled steps: full vs offload policy/explicit)"
  timeout $(( ${OVERLAP_TIMEOUT_S:-150} + 30 )) python3 -m experiments.probes.offload_overlap \
    --deadline-s "${OVERLAP_TIMEOUT_S:-150}" --out "$OUT/offload_overlap.json" \
    --trace "$OUT/overlap_trace.json.gz" ${OVERLAP_ARGS:-} 2>&1 | tail -12 \
    | tee -a "$OUT/check.log"
fi

if has scaling; then
  # Issue #15's scaling table: 8B LoRA at 1 x 4096 per GPU on 1, 2, 4, 8 GPUs (those this machine has), data
  # parallel and FSDP, one process per point (experiments/probes/bench_scaling.py). SCALING_ARGS passes more options.
  gpus=$(nvidia-smi -L | wc -l)
  counts=$(for n in 1 2 4 8; do [ "$n" -le "$gpus" ] && echo "$n"; done | paste -sd, -)
  stamp "scaling (8B LoRA, 1 x 4096 per GPU, dp and fsdp on $counts GPUs, ${SCALING_SYSTEMS:-jaxft,hf_ckpt})"
  timeout "${SCALING_TIMEOUT_S:-560}" python3 -m experiments.probes.bench_scaling --devices "$counts" \
    --systems "${SCALING_SYSTEMS:-jaxft,hf_ckpt}" --json "$OUT/scaling.json" --md "$OUT/scaling.md" \
    ${SCALING_ARGS:-} 2>&1 | grep -v "Warning\|warn" | tail -20 | tee -a "$OUT/check.log"
fi

if has 70b; then
  # Issue #15's 70B run: Llama-3.1-70B shape, LoRA r16 on all linears, 1 x 4096 per GPU, FSDP over every GPU.
  gpus=$(nvidia-smi -L | wc -l)
  stamp "70b (FSDP over $gpus GPUs, 1 x 4096 per GPU)"
  timeout "$(( ${SCALING_70B_TIMEOUT_S:-560} + 20 ))" python3 -m experiments.probes.bench_scaling --workload 70b_4096 \
    --devices "$gpus" --meshes fsdp --systems jaxft --steps 5 --timeout "${SCALING_70B_TIMEOUT_S:-560}" \
    --json "$OUT/scaling_70b.json" \
    --md "$OUT/scaling_70b.md" 2>&1 | grep -v "Warning\|warn" | tail -8 | tee -a "$OUT/check.log"
fi

if has gmm; then
  stamp "grouped matmul benchmark (MoE expert shapes: lax.ragged_dot vs the Mosaic GPU kernels vs dense)"
  timeout "${GMM_TIMEOUT_S:-200}" python3 -m experiments.kernels.grouped_matmul_bench --json "$OUT/gmm.json" \
    2>&1 | grep -v '^  File\|^    ' | tail -40 | tee -a "$OUT/check.log"
fi

if has gmmsweep; then
  stamp "grouped matmul tile sweep (row kernels forward / d lhs, d rhs kernel: candidate tiles per MoE shape)"
  timeout "${GMM_TIMEOUT_S:-300}" python3 -m experiments.kernels.grouped_matmul_bench --sweep ${GMM_SWEEP_ARGS:-} \
    --json "$OUT/gmm_sweep.json" \
    2>&1 | grep -v '^  File\|^    ' | tail -120 | tee -a "$OUT/check.log"
fi

if has gmmprobe; then
  stamp "grouped matmul probe (the forward row kernel on derived problems: equal groups, one group, K x2 / x4)"
  timeout "${GMM_TIMEOUT_S:-200}" python3 -m experiments.kernels.grouped_matmul_bench --probe ${GMM_PROBE_ARGS:-} \
    --json "$OUT/gmm_probe.json" \
    2>&1 | grep -v '^  File\|^    ' | tail -60 | tee -a "$OUT/check.log"
fi

stamp done
