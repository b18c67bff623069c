#!/usr/bin/env bash
# The GPU check, one device call: the GPU tests and a short training scoreboard (jaxft vs HF+PEFT vs Unsloth,
# python -m scripts.bench.train). Results go under $OUT (at most 8 files come back: check.log,
# bench_train.{json,md}, bench_logs.tgz). Phases and sizes are chosen by environment variables:
#   PHASES="env tests train"   (the default); "ce" adds the linear cross-entropy op's benchmark, "nf4" the 4-bit
#   matmul's (kernels_pallas/<op>/bench.py; rows to check.log). The lab's device probes (forward check,
#   attention, offload, max context, scaling, grouped-matmul sweeps) are experiments/gpu_probes.sh.
#   TRAIN_PLAN="jaxft,hf_ckpt|8b_4096|300;jaxft,unsloth|8b_packed_16384|120"  TRAIN_RESUME=old.json
#   DEADLINE_S=540 (later passes shrink or are skipped to end in time)  TRAIN_STEPS=12
#   TESTS="tests/test_x.py ..." (default: every gpu-marked test)
#   TESTS_WORKERS=6 (pytest-xdist workers for the gpu tests; 1: one process)  TESTS_TIMEOUT_S=150 (per pytest call)
#   TESTS_SERIAL_MEM_GIB=24 (the serial call's GPU share, at most half)
#   TRAIN_GPUS=1 (default: sessions one after another on one GPU) | N | all (scripts.bench.train --gpus: up to N
#   sessions at once, each worker pinned to its own GPU by CUDA_VISIBLE_DEVICES; ceilings + model saves first, on GPU 0).
#   On a multi-GPU kind (e.g. 8 x H200) TRAIN_GPUS=all runs the whole table (5 systems x 5 workloads) in one call:
#     OUT=$OUT PHASES=train TRAIN_GPUS=all TRAIN_PLAN="jaxft,jaxft_lean,unsloth,hf_ckpt,hf_nockpt|1b_2x4096,8b_4096,8b_16384,qwen3_8b_4096,8b_packed_16384|560" bash scripts/gpu_check.sh
#   and issue #10's table (every remat policy, auto and the peers on its six rows; a system per GPU; continue a cut
#   call with TRAIN_RESUME=<its bench_train.json>):
#     OUT=$OUT PHASES=train TRAIN_GPUS=all TRAIN_PLAN="jaxft,jaxft_full_remat,jaxft_lean,jaxft_offload_attn,jaxft_lean_attn,jaxft_auto,unsloth,hf_ckpt|8b_4096,8b_16384,8b_32768,8b_65536,8b_packed_16384,8b_packed_65536|560" bash scripts/gpu_check.sh
#   and the streamed weights (frozen_weights: host) beside lean and Unsloth at 64k:
#     OUT=$OUT PHASES=train TRAIN_EXTRA_ARGS="--no-ceiling" TRAIN_PLAN="jaxft_offload_attn_host,jaxft_offload_attn,jaxft_lean,unsloth|8b_65536|585" bash scripts/gpu_check.sh
#   JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache (opt-in, JAX's own setting): every process of the call shares a disk
#   cache of compiled programs, so a later pass (or a resumed session) reads a step an earlier one compiled.
# Usage (device tool, repo root):  COMMIT=<local git rev-parse HEAD> OUT=$OUT bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the results folder}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1  # every tool runs as `python3 -m ...` from the repo root
export XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=2
PHASES=${PHASES:-"env tests train"}
# COMMIT: the tree's commit, given by the caller: a device machine's copy of the tree can carry another HEAD (the
# last submitted commit) under a newer working tree, so `git rev-parse` there may name code that did not run.
COMMIT=${COMMIT:-$(cat .commit 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)}
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
  # out of memory there; the H200's 139 GB hid it.
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

if has ce; then
  stamp "linear cross-entropy benchmark"
  timeout "${CE_TIMEOUT_S:-90}" python3 -m kernels_pallas.linear_cross_entropy.bench --modes forward,grad_hidden \
    2>&1 | tail -30 | tee -a "$OUT/check.log"
fi

if has nf4; then
  stamp "nf4 matmul benchmark (8B projections, M = 4k..16k: dense bf16 vs dequantise-then-matmul vs the reference)"
  # Every row to check.log (36 of them), the last ones to the call's output.
  timeout "${NF4_TIMEOUT_S:-120}" python3 -m kernels_pallas.nf4_matmul.bench --iters 5 \
    2>&1 | grep -v "Warning\|warn\|^  " | tee -a "$OUT/check.log" | tail -30
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
    python3 -m scripts.bench.train --systems "$systems" --workloads "$workloads" --steps "${TRAIN_STEPS:-12}" \
      --budget-s "$budget" --gpus "${TRAIN_GPUS:-1}" --commit "$COMMIT" "${wheels[@]}" ${resume:+--resume "$resume"} \
      ${TRAIN_EXTRA_ARGS:-} --out "$OUT/bench_train.json" --md "$OUT/bench_train.md" --logs "$OUT/bench_logs" 2>&1 | tail -40
    [ -f "$OUT/bench_train.json" ] && cp "$OUT/bench_train.json" /tmp/bench_train_resume.json \
      && resume=/tmp/bench_train_resume.json
  done
  # The device returns at most 8 files: one archive for the per-run logs and profile summaries.
  [ -d "$OUT/bench_logs" ] && tar czf "$OUT/bench_logs.tgz" -C "$OUT" bench_logs && rm -rf "$OUT/bench_logs"
fi
stamp done
