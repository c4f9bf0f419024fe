#!/usr/bin/env bash
# The next matmul's weights asked of the L2 by the launches before it that stream little
# (the fused Gated DeltaNet decode block, split-KV attention decode; `FLASHRT_PREFETCH_NEXT_MB`,
# CudaOptions::prefetch_next). One device call, one binary, the prefetch sizes alternated.
#   1. GPU tests with a prefetch larger than any weight (so every launch that takes one asks
#      for a whole matrix): batched rows bit-identical to single steps, bf16 against the CPU
#      reference, capsules, speculative decoding.
#   2. `flashrt bench --batch 1,2,4,8` at 2048 on models/qwen36-27b.toml for each size in PFS
#      (MiB, 0 = off), REPS times alternated; then the 35B-A3B shape and FP8 27B at one row.
#   3. LONG=1: the same at 16384 (batch 1 and 8) for 0 and the largest size.
# Usage (repository root on the GPU machine, carry .gpupack):
#   [PFS="0 16 32"] [REPS=2] [LONG=0] bash benches/run-prefetch-next-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-prefetch-next}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
PFS="${PFS:-0 16 32}"
FLASHRT_PREFETCH_NEXT_MB=4096 "$BIN/cuda_model" --test-threads=1 batched_decode bf16_tracks_cpu_reference \
  capsules_on_gpu speculative_greedy >"$OUT/cuda_model-pf.log" 2>&1 || status=1
echo "== tests (prefetch 4096 MiB)"; grep -hE 'test result|panicked|FAILED' "$OUT/cuda_model-pf.log"
M27="$ROOT/models/qwen36-27b.toml"
M35="$ROOT/models/qwen36-35b-a3b.toml"
b() {
  local name="$1" pf="$2"; shift 2
  run_bench "$name" "$FLASHRT" FLASHRT_PREFETCH_NEXT_MB="$pf" -- "$@" --iters 1
  grep -E '^ +[0-9]+ +[1248] |per step' "$OUT/$name.log" | head -5
}
for i in $(seq "${REPS:-2}"); do
  for pf in $PFS; do b "27b-pf$pf-$i" "$pf" "$M27" --lengths 2048 --decode-steps 32 --batch 1,2,4,8; done
done
for pf in $PFS; do b "35b-pf$pf" "$pf" "$M35" --lengths 2048 --decode-steps 64 --batch 1; done
last="${PFS##* }"
for pf in 0 "$last"; do b "fp8-pf$pf" "$pf" "$M27" --lengths 2048 --quantize fp8 --decode-steps 64 --batch 1; done
if [ "${LONG:-0}" = 1 ]; then
  for pf in 0 "$last"; do b "27b-16k-pf$pf" "$pf" "$M27" --lengths 16384 --decode-steps 16 --batch 1,8; done
fi
exit $status
