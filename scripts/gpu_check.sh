#!/usr/bin/env bash
# One device call: GPU tests, the foundation forward check, kernel benchmarks and the training benchmark.
# Results go under $OUT (JSON + markdown + logs; at most 8 files come back: check.log, forward.json,
# attention.{json,md}, bench_train.{json,md}, bench_logs.tgz). Phases and sizes are chosen by environment variables so
# one script serves a quick check and the full scoreboard:
#   PHASES="env tests forward attention ce train"   (default: all; "nf4" adds the 4-bit matmul benchmark, "gmm" the
#   MoE grouped-matmul benchmark: xla ragged_dot / pallas_mosaic / dense, written to gmm.json, GMM_TIMEOUT_S=200
#   (kernels timed queued back to back, 5 rounds: the bench's docstring);
#   "gmmsweep" its tile sweep (bench --sweep: every candidate tile config per shape and kernel) to gmm_sweep.json;
#   GMM_SWEEP_ARGS="--table-variants --shapes qwen3_30b_a3b_down" narrows it to the table's tiles and their variants;
#   "gmmprobe" the forward row kernel on problems derived from each shape (bench --probe, GMM_PROBE_ARGS) to
#   gmm_probe.json;
#   "offload" the host-offload probe: $OUT/offload_probe.jsonl; OFFLOAD_DUMP=variant,... adds $OUT/offload_dump.tgz;
#   "maxctx" the longest 8B row per remat policy + one real step at 256k: $OUT/max_context.{jsonl,md}, MAXCTX_TIMEOUT_S=360;
#   "probe" the fetch forms a layer loop could read its weights from pinned host memory with, timed (scripts/
#   stream_fetch_probe.py, PROBE_ARGS, PROBE_TIMEOUT_S=150): $OUT/probe.json;
#   "overlap" copy/compute overlap of the host offload from a profile: $OUT/offload_overlap.json and
#   $OUT/overlap_trace.json.gz, OVERLAP_TIMEOUT_S=150;
#   "scaling" 8B LoRA on 1-8 GPUs, data parallel and FSDP, jaxft beside HF+PEFT under accelerate (SCALING_SYSTEMS,
#   default jaxft,hf_ckpt): $OUT/scaling.{json,md}, SCALING_TIMEOUT_S=560 (the JSON is rewritten after each point;
#   each row's wall_s is its whole child process: 7 points per system on 8 GPUs may need two calls, e.g.
#   SCALING_ARGS="--devices 1,2" then "--devices 4,8", both systems in each);
#   "70b" Llama-3.1-70B-shaped LoRA, FSDP over 8 GPUs (random weights made sharded): $OUT/scaling_70b.{json,md},
#   SCALING_70B_TIMEOUT_S=560)
#   TRAIN_PLAN="jaxft,hf_ckpt|8b_4096|300;jaxft,unsloth|8b_packed_16384|120"  TRAIN_RESUME=old.json
#   DEADLINE_S=540 (later passes shrink or are skipped to end in time)  TRAIN_STEPS=12  ATTN_BUDGET_S=120  TESTS="tests/test_x.py ..." (default: every gpu-marked test)
#   TESTS_WORKERS=6 (pytest-xdist workers for the gpu tests; 1: one process)  TESTS_TIMEOUT_S=150 (per pytest call)
#   TESTS_SERIAL_MEM_GIB=24 (the serial call's GPU share, at most half)
#   TRAIN_GPUS=1 (default: sessions one after another on one GPU) | N | all (bench_train.py --gpus: up to N
#   sessions at once, each worker pinned to its own GPU by CUDA_VISIBLE_DEVICES; ceilings + model saves first, on GPU 0).
#   On a multi-GPU kind (e.g. 8 x H200) TRAIN_GPUS=all runs the whole table (5 systems x 5 workloads) in one call:
#     OUT=$OUT PHASES=train TRAIN_GPUS=all TRAIN_PLAN="jaxft,jaxft_lean,unsloth,hf_ckpt,hf_nockpt|1b_2x4096,8b_4096,8b_16384,qwen3_8b_4096,8b_packed_16384|560" bash scripts/gpu_check.sh
#   and issue #10's table (every remat policy, auto and the peers on its six rows; a system per GPU; continue a cut
#   call with TRAIN_RESUME=<its bench_train.json>):
#     OUT=$OUT PHASES=train TRAIN_GPUS=all TRAIN_PLAN="jaxft,jaxft_full_remat,jaxft_lean,jaxft_offload_attn,jaxft_offload_all,jaxft_auto,unsloth,hf_ckpt|8b_4096,8b_16384,8b_32768,8b_65536,8b_packed_16384,8b_packed_65536|560" bash scripts/gpu_check.sh
#   and the streamed weights (frozen_weights: host, docs/benchmarks.md section 36) beside lean and Unsloth at 64k:
#     OUT=$OUT PHASES=train TRAIN_EXTRA_ARGS="--no-ceiling" TRAIN_PLAN="jaxft_offload_attn_host,jaxft_offload_attn,jaxft_lean,unsloth|8b_65536|585" bash scripts/gpu_check.sh
#   JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache (opt-in, JAX's own setting): every process of the call shares a disk
#   cache of compiled programs, so a later pass (or a resumed session) reads a step an earlier one compiled.
# Usage (device tool, repo root):  OUT=$OUT bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the results folder}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=2
PHASES=${PHASES:-"env tests forward attention ce train"}
COMMIT=$(cat .commit 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)
has() { [[ " $PHASES " == *" $1 "* ]]; }
stamp() { echo "[gpu_check $(date +%T)] $*"; }

if has env; then
  stamp env
  { date -u +%FT%TZ; echo "commit $COMMIT"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
    python3 -c "import jax, flax, optax, orbax.checkpoint as o, transformers, peft, torch, triton;
print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__);
print('transformers', transformers.__version__, 'peft', peft.__version__, 'torch', torch.__version__, 'triton', triton.__version__);
print(jax.devices())"; } 2>&1 | tee -a "$OUT/check.log"
fi

if has tests; then
  stamp "gpu tests"
  # Two pytest calls at once. The `serial` tests (they read compiled memory sizes, which may depend on the memory
  # XLA compiles for) in one process with their own share of the GPU (TESTS_SERIAL_MEM_GIB, or
  # TESTS_SERIAL_MEM_FRACTION; they compile programs of < 1 GiB temp and one 8k x 128k cross-entropy of ~13 GB,
  # within 24 GiB); the others on
  # TESTS_WORKERS pytest-xdist workers (1: one process) sharing what is left, tests that share a module-scoped
  # compile kept on one worker (xdist_group, --dist loadgroup). The suite is compile-bound (CPU): 16 cores feed
  # 1 + TESTS_WORKERS processes. pytest-xdist comes from the image, else from the wheels in .peers/pytest when
  # they are there. Only files that mark gpu tests are collected (imports cost seconds per file; the serial call
  # collects only the files that mark serial tests), the slowest files first: xdist hands tests out in collection
  # order, so the long ones start at once instead of last. TESTS_TIMEOUT_S bounds each call. Written to the logs
  # as they run (no tail in the pipe): a timeout must not swallow the failure report, and every test's duration
  # goes to $OUT/gpu_durations.log as it ends (tests/conftest.py), moved into check.log slowest first at the end.
  workers=${TESTS_WORKERS:-6}
  if ! python3 -c "import xdist" 2>/dev/null && compgen -G ".peers/pytest/*.whl" > /dev/null; then
    python3 -m pip install -q --no-deps .peers/pytest/*.whl 2>&1 | tail -3
  fi
  # bitsandbytes (not on the image) for the byte-exact quantiser tests: the carried peer wheel, when there.
  if ! python3 -c "import bitsandbytes" 2>/dev/null && compgen -G ".peers/unsloth/bitsandbytes-*.whl" > /dev/null; then
    python3 -m pip install -q --no-deps .peers/unsloth/bitsandbytes-*.whl 2>&1 | tail -3
  fi
  if [ "$workers" -gt 1 ] && ! python3 -c "import xdist" 2>/dev/null; then
    stamp "no pytest-xdist: the gpu tests run in one process"; workers=1
  fi
  parallel=(); [ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadgroup)
  # The serial call's share is a size, not a fraction: its tests need ~13 GB at most, and what it does not use the
  # parallel workers get. As a fixed fraction (0.5) the workers had 6 GiB each on an H100 (80 GB) and two tests ran
  # out of memory there (docs/benchmarks.md section 41); the H200's 139 GB hid it.
  gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  serial_fraction=${TESTS_SERIAL_MEM_FRACTION:-$(awk -v m="${gpu_mib:-0}" -v want="${TESTS_SERIAL_MEM_GIB:-24}" \
    'BEGIN { f = (m > 0) ? want * 1024 / m : 0.5; if (f > 0.5) f = 0.5; printf "%.3f", f }')}
  fraction=$(awk -v n="$workers" -v s="$serial_fraction" 'BEGIN { printf "%.3f", (0.95 - s) / n }')
  slow_first="tests/test_train_gpu.py tests/test_gemma_gpu.py tests/test_moe_gpu.py tests/test_remat_gpu.py
    tests/test_grouped_matmul_gpu.py tests/test_qwen2_vl_gpu.py tests/test_gpt_oss.py tests/test_attention_auto.py"
  gpu_files=$(grep -l "mark\.gpu" tests/test_*.py)
  ordered=$(for f in $slow_first; do [[ " $(echo $gpu_files) " == *" $f "* ]] && echo "$f"; done;
            for f in $gpu_files; do [[ " $(echo $slow_first) " == *" $f "* ]] || echo "$f"; done)
  test_files=${TESTS:-$(echo $ordered)}
  serial_files=$(grep -l "pytest\.mark\.serial" $test_files | tr '\n' ' ')
  pytest_args=(-v --durations=20 -p no:cacheprovider -rfEs --tb=short)
  serial_log=$(mktemp)
  export JAXFT_FAILURE_LOG="$OUT/gpu_failures.log"  # tests/conftest.py: each failure's traceback when it happens
  export JAXFT_DURATIONS_LOG="$OUT/gpu_durations.log"  # ... and each test's duration
  stamp "serial: $serial_files (memory fraction $serial_fraction); parallel: $workers workers x $fraction"
  started=$SECONDS
  if [ -n "$serial_files" ]; then
    ( XLA_PYTHON_CLIENT_MEM_FRACTION=$serial_fraction timeout "${TESTS_TIMEOUT_S:-150}" python3 -m pytest \
        "${pytest_args[@]}" -m "gpu and serial" $serial_files > "$serial_log" 2>&1
      echo "serial pytest: rc $? after $(( SECONDS - started )) s" >> "$serial_log" ) &
    serial_pid=$!
  fi
  XLA_PYTHON_CLIENT_MEM_FRACTION=$fraction timeout "${TESTS_TIMEOUT_S:-150}" python3 -m pytest "${pytest_args[@]}" \
    ${parallel[@]+"${parallel[@]}"} -m "gpu and not serial" $test_files >> "$OUT/check.log" 2>&1
  echo "parallel pytest: rc $? after $(( SECONDS - started )) s" >> "$OUT/check.log"
  [ -n "$serial_files" ] && wait "$serial_pid"
  { echo "---- serial gpu tests (run beside the parallel ones)"; cat "$serial_log"; } >> "$OUT/check.log"
  rm -f "$serial_log"
  [ -s "$JAXFT_FAILURE_LOG" ] && { echo "---- failures (tracebacks, written as they happened)"; cat "$JAXFT_FAILURE_LOG"; } >> "$OUT/check.log"
  { echo "---- gpu tests: $(( SECONDS - started )) s wall for both calls; slowest phases (s, phase, outcome, worker, test; main = the serial call)"
    [ -s "$JAXFT_DURATIONS_LOG" ] && sort -rn "$JAXFT_DURATIONS_LOG" | head -40; } >> "$OUT/check.log"
  rm -f "$JAXFT_DURATIONS_LOG"  # now in check.log: at most 8 files come back from a device call
  unset JAXFT_FAILURE_LOG JAXFT_DURATIONS_LOG
  tail -80 "$OUT/check.log"
fi

if has forward; then
  stamp "forward check (Llama-3.2-1B shape, bf16 vs fp32, every attention implementation)"
  timeout "${FORWARD_TIMEOUT_S:-150}" python3 scripts/gpu_forward_check.py --out "$OUT/forward.json" 2>&1 | tail -20
fi

if has attention; then
  stamp "attention benchmark"
  timeout "${ATTN_TIMEOUT_S:-180}" python3 scripts/bench_attention.py --out "$OUT/attention.json" \
    --time-budget-s "${ATTN_BUDGET_S:-140}" 2>&1 | tail -30
fi

if has ce; then
  stamp "linear cross-entropy benchmark"
  timeout "${CE_TIMEOUT_S:-90}" python3 -m kernels_pallas.linear_cross_entropy.bench --modes forward,grad_hidden \
    2>&1 | tail -30 | tee -a "$OUT/check.log"
fi

if has offload; then
  # Host-offloaded remat: copies in the compiled HLO, temp and real peaks per policy / loop / attention / transfer
  # (one JSON line per variant; scripts/offload_probe.py says what is counted). About 2-3 minutes on an H200.
  stamp "offload probe (remat none/full/offload/offload_explicit x scan/unroll, mini + 4-layer 1B-width recipe)"
  # OFFLOAD_DUMP="mini/offload,jaxft/offload_explicit/unroll" also dumps those variants' HLO (before/after XLA's
  # passes, the host-offload passes, buffer assignment) into $OUT/offload_dump.tgz.
  dump=()
  [ -n "${OFFLOAD_DUMP:-}" ] && dump=(--dump /tmp/offload_dump --dump-only "$OFFLOAD_DUMP")
  timeout "${OFFLOAD_TIMEOUT_S:-300}" python3 scripts/offload_probe.py --out "$OUT/offload_probe.jsonl" \
    "${dump[@]}" ${OFFLOAD_ARGS:-} 2>&1 | tee -a "$OUT/check.log" | grep "^#"
  [ -d /tmp/offload_dump ] && tar czf "$OUT/offload_dump.tgz" -C /tmp offload_dump
fi

if has maxctx; then
  # Compile-only searches (one process per policy, no weights on the device) beside one real step at 262144 tokens
  # (random weights); everything ends by MAXCTX_TIMEOUT_S (the step alone is ~4-5 minutes: compile + ~170 s step).
  # MAXCTX_ARGS passes more options (e.g. "--step-seq 0", "--policies offload,full", "--host-memory-gb 128").
  stamp "max context (8B shape, batch 1, every remat policy; compiled memory + host accounting; one real step)"
  XLA_PYTHON_CLIENT_MEM_FRACTION=${MAXCTX_MEM_FRACTION:-0.95} timeout $(( ${MAXCTX_TIMEOUT_S:-360} + 60 )) \
    python3 scripts/max_context.py --deadline-s "${MAXCTX_TIMEOUT_S:-360}" --out "$OUT/max_context.jsonl" \
    --md "$OUT/max_context.md" ${MAXCTX_ARGS:-} 2>&1 | grep -v '^{"event": "probe"' | tail -40 | tee -a "$OUT/check.log"
fi

if has probe; then
  stamp "stream fetch probe"
  timeout "${PROBE_TIMEOUT_S:-150}" python3 scripts/stream_fetch_probe.py --out "$OUT/probe.json" \
    ${PROBE_ARGS:---layers 16 --tokens 16384} 2>&1 | tee -a "$OUT/check.log" | tail -10
fi

if has overlap; then
  # A profile of 3 steps of 4 layers of the 8B width, 1 x 8192: full vs offload (policy transfer in the scan,
  # explicit transfer unrolled); per-layer backward, copy time, copy/compute overlap, copy streams.
  stamp "offload overlap (profiled steps: full vs offload policy/explicit)"
  timeout $(( ${OVERLAP_TIMEOUT_S:-150} + 30 )) python3 scripts/offload_overlap.py --deadline-s "${OVERLAP_TIMEOUT_S:-150}" \
    --out "$OUT/offload_overlap.json" --trace "$OUT/overlap_trace.json.gz" ${OVERLAP_ARGS:-} 2>&1 | tail -12 \
    | tee -a "$OUT/check.log"
fi

if has scaling; then
  # Issue #15's scaling table: 8B LoRA at 1 x 4096 per GPU on 1, 2, 4, 8 GPUs (those this machine has), data
  # parallel and FSDP, one process per point (scripts/bench_scaling.py). SCALING_ARGS passes more options.
  gpus=$(nvidia-smi -L | wc -l)
  counts=$(for n in 1 2 4 8; do [ "$n" -le "$gpus" ] && echo "$n"; done | paste -sd, -)
  stamp "scaling (8B LoRA, 1 x 4096 per GPU, dp and fsdp on $counts GPUs, ${SCALING_SYSTEMS:-jaxft,hf_ckpt})"
  timeout "${SCALING_TIMEOUT_S:-560}" python3 scripts/bench_scaling.py --devices "$counts" \
    --systems "${SCALING_SYSTEMS:-jaxft,hf_ckpt}" --json "$OUT/scaling.json" --md "$OUT/scaling.md" \
    ${SCALING_ARGS:-} 2>&1 | grep -v "Warning\|warn" | tail -20 | tee -a "$OUT/check.log"
fi

if has 70b; then
  # Issue #15's 70B run: Llama-3.1-70B shape, LoRA r16 on all linears, 1 x 4096 per GPU, FSDP over every GPU.
  gpus=$(nvidia-smi -L | wc -l)
  stamp "70b (FSDP over $gpus GPUs, 1 x 4096 per GPU)"
  timeout "$(( ${SCALING_70B_TIMEOUT_S:-560} + 20 ))" python3 scripts/bench_scaling.py --workload 70b_4096 \
    --devices "$gpus" --meshes fsdp --systems jaxft --steps 5 --timeout "${SCALING_70B_TIMEOUT_S:-560}" \
    --json "$OUT/scaling_70b.json" \
    --md "$OUT/scaling_70b.md" 2>&1 | grep -v "Warning\|warn" | tail -8 | tee -a "$OUT/check.log"
fi

if has nf4; then
  stamp "nf4 matmul benchmark (8B projections, M = 4k..16k: dense bf16 vs dequantise-then-matmul vs the Pallas kernels)"
  # Every row to check.log (48 of them), the last ones to the call's output.
  timeout "${NF4_TIMEOUT_S:-120}" python3 -m kernels_pallas.nf4_matmul.bench --iters 5 \
    2>&1 | grep -v "Warning\|warn\|^  " | tee -a "$OUT/check.log" | tail -30
fi

if has gmm; then
  stamp "grouped matmul benchmark (MoE expert shapes: lax.ragged_dot vs the Mosaic GPU kernels vs dense)"
  timeout "${GMM_TIMEOUT_S:-200}" python3 -m kernels_pallas.grouped_matmul.bench --json "$OUT/gmm.json" \
    2>&1 | grep -v '^  File\|^    ' | tail -40 | tee -a "$OUT/check.log"
fi

if has gmmsweep; then
  stamp "grouped matmul tile sweep (row kernels forward / d lhs, d rhs kernel: candidate tiles per MoE shape)"
  timeout "${GMM_TIMEOUT_S:-300}" python3 -m kernels_pallas.grouped_matmul.bench --sweep ${GMM_SWEEP_ARGS:-} \
    --json "$OUT/gmm_sweep.json" \
    2>&1 | grep -v '^  File\|^    ' | tail -120 | tee -a "$OUT/check.log"
fi

if has gmmprobe; then
  stamp "grouped matmul probe (the forward row kernel on derived problems: equal groups, one group, K x2 / x4)"
  timeout "${GMM_TIMEOUT_S:-200}" python3 -m kernels_pallas.grouped_matmul.bench --probe ${GMM_PROBE_ARGS:-} \
    --json "$OUT/gmm_probe.json" \
    2>&1 | grep -v '^  File\|^    ' | tail -60 | tee -a "$OUT/check.log"
fi

if has train; then
  # TRAIN_PLAN: passes "systems|workloads|budget_s" separated by ';'. Each pass resumes from the previous
  # pass's table (runs already ok/oom are kept), so one call fills one table in priority order.
  plan=${TRAIN_PLAN:-"jaxft,jaxft_lean,hf_ckpt,hf_nockpt,unsloth|1b_2x4096,8b_4096|400"}
  resume=${TRAIN_RESUME:-}
  wheels=()
  [ -d .peers/unsloth ] && wheels=(--unsloth-wheels .peers/unsloth)
  IFS=';' read -ra passes <<< "$plan"
  for pass in "${passes[@]}"; do
    IFS='|' read -r systems workloads budget <<< "$pass"
    if [ -n "${DEADLINE_S:-}" ]; then  # the whole script must end by DEADLINE_S seconds after its start
      left=$(( DEADLINE_S - SECONDS - 20 ))
      [ "$left" -lt "$budget" ] && budget=$left
      [ "$budget" -lt 60 ] && { stamp "skip pass ($systems on $workloads): ${budget}s left"; continue; }
    fi
    stamp "training benchmark: $systems on $workloads (budget ${budget}s)"
    python3 scripts/bench_train.py --systems "$systems" --workloads "$workloads" --steps "${TRAIN_STEPS:-12}" \
      --budget-s "$budget" --gpus "${TRAIN_GPUS:-1}" --commit "$COMMIT" "${wheels[@]}" ${resume:+--resume "$resume"} \
      ${TRAIN_EXTRA_ARGS:-} --out "$OUT/bench_train.json" --md "$OUT/bench_train.md" --logs "$OUT/bench_logs" 2>&1 | tail -40
    [ -f "$OUT/bench_train.json" ] && cp "$OUT/bench_train.json" /tmp/bench_train_resume.json \
      && resume=/tmp/bench_train_resume.json
  done
  # The device returns at most 8 files: one archive for the per-run logs and profile summaries.
  [ -d "$OUT/bench_logs" ] && tar czf "$OUT/bench_logs.tgz" -C "$OUT" bench_logs && rm -rf "$OUT/bench_logs"
fi
stamp done
