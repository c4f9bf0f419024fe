#!/usr/bin/env bash
# What the CPU-only session of 2026-12-04 04:26 UTC built for the GPU and could not run, in ONE
# command on the GPU machine (results in OUT; benches/RESULTS.md names each):
#
#   1. every GPU test suite (scripts/gpu-check.sh): among them the new
#      cuda_sample::device_penalties_choose_what_the_host_chooses, the penalties case of
#      cuda_sample::sessions_sample_the_same_on_device_and_host, and
#      cuda_model::row_states_roll_back_like_a_replay_on_gpu; and the refactored CUDA op
#      builders and session (code moved, same launches);
#   2. the candidate tensor-core gemv (kernels/gemv_tc.cu, FLASHRT_GEMV16_TC=1) in the kernel
#      microbenchmark, 8 and 4 weight rows a block (`tc` lines next to `cores` and `mma`), its
#      GPU tests (cuda_ops gemv/linear, cuda_model batched / verify / speculative steps with the
#      variable set), and whole steps: `flashrt bench --batch 1,2,4,8` with it and without;
#   3. a speculative round's costs on the 27B shape with and without per-row states
#      (FLASHRT_ROW_STATES=1: the "kept" column).
#
# Built here first (git-ignored .gpu/):
#   bash scripts/gpu-check.sh --collect                      # .gpu/bin/cuda_*
#   .venv/nvcc/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels \
#       -L .venv/nvcc/cuda/lib \
#       -o .gpu/extra/gemvm_micro benches/kernels/gemvm_micro.cu
#   cargo build --release --features cuda -p flashrt-runtime --example speculative_costs
#   cargo build --release --features cuda && strip target/release/flashrt -o .gpu/flashrt
#   cp target/release/examples/speculative_costs .gpu/extra/ && strip .gpu/extra/speculative_costs
#   (.gpu/extra, not .gpu/bin: gpu-check.sh runs everything in bin/)
#
# The binaries come to the GPU machine packed (more than the 64 MiB a device call carries
# unpacked): `tar -cJf .gpupack2/gpu.tar.xz .gpu` here (~45 MB), carry `.gpupack2`; the script
# unpacks it when `.gpu/bin` is missing.
#
# Usage (repository root on the GPU machine): bash benches/run-pending-h200.sh OUT
# All of it may pass the 600 s a device call allows: TESTS=0, MICRO=0, TC=0, BENCH=0, SPEC=0
# skip parts (e.g. one call with BENCH=0 SPEC=0, one with TESTS=0 MICRO=0 TC=0).
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-pending}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/.gpu/bin"
EXTRA="$ROOT/.gpu/extra"
if [ ! -d "$BIN" ] && [ -f "$ROOT/.gpupack2/gpu.tar.xz" ]; then
  tar -xJf "$ROOT/.gpupack2/gpu.tar.xz" -C "$ROOT"
fi
mkdir -p "$OUT"
export FLASHRT_FIXTURES="$ROOT/tests/fixtures" RUST_BACKTRACE=1
status=0
if [ "${TESTS:-1}" != 0 ]; then
  OUT="$OUT/tests" bash "$ROOT/scripts/gpu-check.sh" "$ROOT/.gpu" >"$OUT/gpu-check.log" 2>&1 || status=1
  tail -12 "$OUT/gpu-check.log"
fi
if [ "${MICRO:-1}" != 0 ] && [ -x "$EXTRA/gemvm_micro" ]; then
  timeout 120 "$EXTRA/gemvm_micro" >"$OUT/micro.log" 2>&1 || status=1
  MB_TC_F4=1 timeout 120 "$EXTRA/gemvm_micro" >"$OUT/micro-f4.log" 2>&1 || status=1
  grep -E '^(bf16|fp8)|R=1 |R=8 |invariant' "$OUT/micro.log"
  echo "== 4 rows a block (down, out)"; grep -E '^bf16 (down|out)| tc |tc:' "$OUT/micro-f4.log"
fi
if [ "${TC:-1}" != 0 ] && [ -x "$BIN/cuda_model" ]; then
  {
    FLASHRT_GEMV16_TC=1 timeout 150 "$BIN/cuda_ops" --test-threads=1 linear gemv 2>&1
    FLASHRT_GEMV16_TC=1 timeout 200 "$BIN/cuda_model" --test-threads=1 batched_decode short_suffixes \
      speculative_greedy bf16_tracks 2>&1
  } >"$OUT/tests-tc.log" || status=1
  echo "== tests with FLASHRT_GEMV16_TC=1"; grep -hE '^test |test result|panicked' "$OUT/tests-tc.log" | grep -v ' ok$'
fi
if [ "${BENCH:-1}" != 0 ] && [ -x "$ROOT/.gpu/flashrt" ]; then
  M="$ROOT/models/qwen36-27b.toml"
  for v in 0 1; do
    FLASHRT_GEMV16_TC=$v timeout 150 "$ROOT/.gpu/flashrt" bench "$M" --random-weights --backend cuda \
      --lengths 2048 --iters 2 --decode-steps 24 --batch 1,2,4,8 --json "$OUT/bench-tc$v.json" \
      >"$OUT/bench-tc$v.log" 2>&1 || status=1
    echo "== FLASHRT_GEMV16_TC=$v"; grep -vE ' INFO |^\[|WARN' "$OUT/bench-tc$v.log" | tail -14
  done
fi
if [ "${SPEC:-1}" != 0 ] && [ -x "$EXTRA/speculative_costs" ]; then
  FLASHRT_BACKEND=cuda timeout 200 "$EXTRA/speculative_costs" --model 27b >"$OUT/spec-replay.log" 2>&1 || status=1
  FLASHRT_BACKEND=cuda FLASHRT_ROW_STATES=1 timeout 200 "$EXTRA/speculative_costs" --model 27b \
    >"$OUT/spec-kept.log" 2>&1 || status=1
  echo "== speculative round, 27B: restore + replay"; grep -A20 "one round" "$OUT/spec-replay.log"
  echo "== with kept row states"; grep -A20 "one round" "$OUT/spec-kept.log"
fi
exit $status
