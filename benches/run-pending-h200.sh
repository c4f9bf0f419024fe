#!/usr/bin/env bash
# What the CPU-only session of 2026-12-04 04:26 UTC built for the GPU and could not run, in ONE
# command on the GPU machine (results in OUT; benches/RESULTS.md names each):
#
#   1. every GPU test suite (scripts/gpu-check.sh): among them the new
#      cuda_sample::device_penalties_choose_what_the_host_chooses, the penalties case of
#      cuda_sample::sessions_sample_the_same_on_device_and_host, and
#      cuda_model::row_states_roll_back_like_a_replay_on_gpu; and the refactored CUDA op
#      builders and session (code moved, same launches);
#   2. the candidate tensor-core gemv (benches/kernels/gemv_tc.cu) in the kernel
#      microbenchmark, 8 and 4 weight rows a block (`tc` lines next to `cores` and `mma`);
#   3. a speculative round's costs on the 27B shape with and without per-row states
#      (FLASHRT_ROW_STATES=1: the "kept" column).
#
# Built here first (git-ignored .gpu/):
#   bash scripts/gpu-check.sh --collect                      # .gpu/bin/cuda_*
#   .venv/nvcc/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels \
#       -L .venv/nvcc/cuda/lib \
#       -o .gpu/bin/gemvm_micro benches/kernels/gemvm_micro.cu
#   cargo build --release --features cuda -p flashrt-runtime --example speculative_costs
#   cp target/release/examples/speculative_costs .gpu/bin/ && strip .gpu/bin/speculative_costs
#
# Usage (repository root on the GPU machine): bash benches/run-pending-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-pending}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/.gpu/bin"
mkdir -p "$OUT"
export FLASHRT_FIXTURES="$ROOT/tests/fixtures" RUST_BACKTRACE=1
status=0
OUT="$OUT/tests" bash "$ROOT/scripts/gpu-check.sh" "$ROOT/.gpu" >"$OUT/gpu-check.log" 2>&1 || status=1
tail -12 "$OUT/gpu-check.log"
if [ -x "$BIN/gemvm_micro" ]; then
  timeout 120 "$BIN/gemvm_micro" >"$OUT/micro.log" 2>&1 || status=1
  MB_TC_F4=1 timeout 120 "$BIN/gemvm_micro" >"$OUT/micro-f4.log" 2>&1 || status=1
  grep -E '^(bf16|fp8)|R=1 |R=8 |invariant' "$OUT/micro.log"
  echo "== 4 rows a block (down, out)"; grep -E '^bf16 (down|out)| tc |tc:' "$OUT/micro-f4.log"
fi
if [ -x "$BIN/speculative_costs" ]; then
  FLASHRT_BACKEND=cuda timeout 200 "$BIN/speculative_costs" --model 27b >"$OUT/spec-replay.log" 2>&1 || status=1
  FLASHRT_BACKEND=cuda FLASHRT_ROW_STATES=1 timeout 200 "$BIN/speculative_costs" --model 27b \
    >"$OUT/spec-kept.log" 2>&1 || status=1
  echo "== speculative round, 27B: restore + replay"; grep -A20 "one round" "$OUT/spec-replay.log"
  echo "== with kept row states"; grep -A20 "one round" "$OUT/spec-kept.log"
fi
exit $status
