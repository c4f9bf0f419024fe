#!/usr/bin/env bash
# Issue 17: an FP8 layer's bf16 Gated DeltaNet in_proj_b / _a as a side launch beside the FP8
# in_proj_qkv / _z launch (`FLASHRT_GEMV_SIDE`, CudaOptions::gemv_side), one short device call:
#   1. cuda_fp8 whole with the option on (its new test compares off and on bit for bit);
#   2. `flashrt bench models/qwen36-27b.toml --quantize fp8 --iters 1 --lengths 2048
#      --decode-steps 32 --batch 1` off and on, alternated, REPS rounds.
# Usage (repository root on the GPU machine, carry .gpupack with .gpu/flashrt, .gpu/bin/cuda_fp8):
#   [REPS=2] bash benches/run-gemv-side-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-gemv-side}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
head -1 "$OUT/device.txt"
FLASHRT_GEMV_SIDE=1 timeout 150 "$BIN/cuda_fp8" --test-threads=1 >"$OUT/cuda_fp8.log" 2>&1 || status=1
echo "== cuda_fp8 (side on)"; grep -hE 'test result|panicked|FAILED' "$OUT/cuda_fp8.log"
for i in $(seq 1 "${REPS:-2}"); do
  for on in 0 1; do
    run_bench "27b8-side$on-$i" "$FLASHRT" FLASHRT_GEMV_SIDE="$on" -- "$ROOT/models/qwen36-27b.toml" --iters 1 \
      --lengths 2048 --decode-steps 32 --batch 1 --quantize fp8 >/dev/null
    echo "side $on $i: $(grep -hE 'batch 1:' "$OUT/27b8-side$on-$i.log" | head -1 | cut -c17-); $(grep -ohE 'restored TTFT [0-9.]+ ms' "$OUT/27b8-side$on-$i.log" | head -1)"
  done
done
exit $status
