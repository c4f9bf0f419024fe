#!/usr/bin/env bash
# The 2026-12-06 09:04 UTC session's GPU check (issue 16's 16k cold TTFT): the prefill experts'
# grouped GEMMs over wide tiles (kernels/moe_wgmma.cu `moe_*_w2`, `CudaOptions::moe_wide`)
# against the 64 x 128 tiles, one device call:
#
#   1. cuda_model: `moe_wide_tiles_compute_what_the_narrow_tiles_compute` (bit-identical
#      prefill chunks), and the MoE model's bf16 comparisons with the CPU reference.
#   2. `flashrt bench models/qwen36-35b-a3b.toml --random-weights --backend cuda --lengths
#      2048,16384 --iters 2 --decode-steps 32 --profile` with FLASHRT_MOE_WIDE=0 then 1 (the
#      profile's prefill chunk shows the experts' GEMMs).
#   3. (BAR=1) the bars' 27B command at 16k (issues 13 and 15), as benches/run-slack-h200.sh.
#
# Built here first (git-ignored .gpu/, carried packed in .gpupack/p.tar.xz):
#   cargo build --release --features cuda && strip --strip-debug target/release/flashrt -o .gpu/flashrt
#   bash scripts/gpu-check.sh --collect
#   tar -cJf .gpupack/p.tar.xz .gpu/bin/cuda_model .gpu/flashrt
#
# Usage (repository root on the GPU machine): [BAR=1] [CLIENTS=4] bash benches/run-moe-wide-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-moe-wide}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
"$BIN/cuda_model" --test-threads=1 moe_wide bf16_tracks_cpu_reference bf16_chunked_prefill unaligned_restore capsules_on_gpu \
  >"$OUT/cuda_model.log" 2>&1 || status=1
grep -hE '^test |test result|bit-identical|panicked' "$OUT/cuda_model.log"
for w in 0 1 0 1; do
  n=35b-wide$w
  [ -f "$OUT/$n.log" ] && n=$n-again
  FLASHRT_MOE_WIDE=$w timeout 300 "$FLASHRT" bench "$ROOT/models/qwen36-35b-a3b.toml" --random-weights \
    --backend cuda --lengths 2048,16384 --iters 2 --decode-steps 32 ${PROFILE:---profile} \
    --json "$OUT/$n.json" >"$OUT/$n.log" 2>&1 || status=1
  echo "== $n"
  grep -E '^ +(2048|16384) ' "$OUT/$n.log" | head -2
  grep -E 'grouped|profile: prefill|moe (plan|combine|tiles)' "$OUT/$n.log" | head -10
  [ "${REPEAT:-0}" = 1 ] || [ $w = 0 ] || break
done
[ "${BAR:-0}" = 1 ] || exit $status
bar16k
exit $status
