#!/usr/bin/env bash
# GPU check of the 2026-12-06 15:35 UTC session's changes, one device call:
#
#   1. cuda_model (the new build): the batched-decode test (every row of 2..8-row steps
#      bit-identical to its session's own steps) and the attention fusions' test.
#   2. `flashrt bench --batch 1,2,4,8` at 2048 on models/qwen36-27b.toml, the previous build
#      (BASE, with FLASHRT_QK_PREP=1 to match the new default) and the new build (NEW: batched
#      steps' Gated DeltaNet blocks from `gdn_decode1_*`, one row a block at 128 registers, two
#      blocks an SM), alternated, and the new build with FLASHRT_ATTN_GATE=1 (the combine
#      kernel triggers its dependent launch at its end when it applies the gate).
#   3. (COLD16=1) cold TTFT at 16384 with qk_prep off (BASE) and on (NEW's default).
#   4. the 35B-A3B decode profile with the new build.
#
# Binaries built here and carried packed: BASE in .gpupack/p.tar.xz (.gpu/flashrt), NEW in
# .gpupack/v2.tar.xz (.gpu/flashrt2, .gpu/cuda_model2).
# Usage (repository root on the GPU machine): [REPS=2] [COLD16=1] bash benches/run-gdn-batch-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-gdn-batch}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
[ -x "$ROOT/.gpu/flashrt2" ] || tar -xJf "$ROOT/.gpupack/v2.tar.xz" -C "$ROOT"
BASE="$FLASHRT" NEW="$ROOT/.gpu/flashrt2"
"$ROOT/.gpu/cuda_model2" --test-threads=1 batched_decode attention_fusions >"$OUT/cuda_model.log" 2>&1 || status=1
grep -hE '^test |test result|panicked' "$OUT/cuda_model.log"
# b NAME BIN [VAR=value ...] -- ARGS...: run_bench at one iteration, the step lines printed.
b() {
  run_bench "$@" --iters 1
  grep -E '^ +[0-9]+ +[1248] |^ +16384 ' "$OUT/$1.log" | head -6
}
M27="$ROOT/models/qwen36-27b.toml"
for i in $(seq "${REPS:-2}"); do
  b base-batch-$i "$BASE" FLASHRT_QK_PREP=1 -- "$M27" --lengths 2048 --decode-steps 32 --batch 1,2,4,8
  b new-batch-$i "$NEW" -- "$M27" --lengths 2048 --decode-steps 32 --batch 1,2,4,8
done
b new-gate "$NEW" FLASHRT_ATTN_GATE=1 -- "$M27" --lengths 2048 --decode-steps 32 --batch 1,2,4,8
if [ "${COLD16:-1}" = 1 ]; then
  b base-16k "$BASE" FLASHRT_QK_PREP=0 -- "$M27" --lengths 16384 --decode-steps 8 --batch 1
  b new-16k "$NEW" -- "$M27" --lengths 16384 --decode-steps 8 --batch 1
fi
b new-35b-profile "$NEW" -- "$ROOT/models/qwen36-35b-a3b.toml" --lengths 2048 --decode-steps 16 --profile
sed -n '/profile: decode/,/^$/p' "$OUT/new-35b-profile.log" | head -24
exit $status
