#!/usr/bin/env bash
# Batched steps' fused Gated DeltaNet blocks taking several rows one after another
# (kernels/gated_deltanet.cu `gdn_decode_rows_*`, CudaOptions::gdn_rows, FLASHRT_GDN_ROWS=N:
# at most N cluster rows) against a cluster row per step row (the default). One device call,
# one binary. Built 2026-12-06 after the last device call; this script is its first run.
#   1. GPU tests: batched rows bit-identical to single steps (the `gdn_rows: 3` case among them:
#      8 rows as 3 + 3 + 2 a cluster row), capsules, bf16 against the CPU reference.
#   2. `flashrt bench --batch 1,2,4,8` at 2048 on models/qwen36-27b.toml, FLASHRT_GDN_ROWS = 0 / 8
#      alternated REPS times, with the CUDA-core and the tensor-core gemv; then both 8-row steps
#      profiled (the Gated DeltaNet block's share: 2.25 ms of 28.7 on the H200 without).
# Usage (repository root on the GPU machine, carry .gpupack): [REPS=1] bash benches/run-gdn-rows-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-gdn-rows}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
"$BIN/cuda_model" --test-threads=1 batched_decode capsules_on_gpu bf16_tracks_cpu_reference \
  >"$OUT/cuda_model.log" 2>&1 || status=1
echo "== tests"; grep -hE 'test result|panicked|FAILED' "$OUT/cuda_model.log"
M27="$ROOT/models/qwen36-27b.toml"
for i in $(seq "${REPS:-1}"); do
  batch27 off-$i
  batch27 rows-$i FLASHRT_GDN_ROWS=8
  batch27 mma-off-$i FLASHRT_GEMV16_MMA=1
  batch27 mma-rows-$i FLASHRT_GEMV16_MMA=1 FLASHRT_GDN_ROWS=8
done
for v in 0 8; do
  run_bench "profile8-$v" "$FLASHRT" FLASHRT_GDN_ROWS=$v -- "$M27" --iters 1 --lengths 2048 --decode-steps 16 --batch 8 --profile
  grep -E 'gated_deltanet|attention decode' "$OUT/profile8-$v.log" | head -3
done
exit $status
