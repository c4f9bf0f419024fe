#!/usr/bin/env bash
# Where the remaining time of three bars goes, on the current defaults (one short device call):
#   1. the 35B-A3B decode step with the MoE prefetch at 32 (the default) and 48 MiB, REPS rounds;
#   2. `--profile` of the 35B-A3B decode step and of the 27B FP8 decode step at 2048 (issues 16,
#      17), and `--profile-rows 4096` after 12288 tokens: the last 4096-row chunk of a cold 16k
#      prefill of the 27B shape (issues 13 / 15's cold-TTFT bar), every kernel's device time.
# Usage (repository root on the GPU machine, carry .gpupack with .gpu/flashrt):
#   [REPS=2] bash benches/run-profiles-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-profiles}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
head -1 "$OUT/device.txt"
M27="$ROOT/models/qwen36-27b.toml" M35="$ROOT/models/qwen36-35b-a3b.toml"
for i in $(seq 1 "${REPS:-2}"); do
  for mb in 32 48; do
    run_bench "35b-pf$mb-$i" "$FLASHRT" FLASHRT_MOE_PREFETCH_MB="$mb" -- "$M35" --iters 1 --lengths 2048 \
      --decode-steps 64 --batch 1 >/dev/null
    echo "35b pf$mb $i: $(grep -hE 'batch 1:' "$OUT/35b-pf$mb-$i.log" | head -1 | cut -c17-)"
  done
done
run_bench p35 "$FLASHRT" -- "$M35" --iters 1 --lengths 2048 --decode-steps 16 --profile
run_bench p27fp8 "$FLASHRT" -- "$M27" --iters 1 --lengths 2048 --decode-steps 16 --profile --quantize fp8
run_bench p27pre "$FLASHRT" -- "$M27" --iters 1 --lengths 12288 --decode-steps 4 --profile-rows 4096
grep -hE '^profile:' "$OUT"/p*.log
exit $status
