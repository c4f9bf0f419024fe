#!/usr/bin/env bash
# The 2026-12-06 09:04 UTC session's second GPU check: the chunked Gated DeltaNet kernel's
# per-chunk phases split off into one launch over all chunks (`CudaOptions::gdn_prep`,
# kernels/gated_deltanet.cu GDNC_PREP / GDNC_USE), with the wide MoE expert GEMMs of
# benches/run-moe-wide-h200.sh. One device call:
#
#   1. cuda_model: the bit-identity tests of both changes, the bf16 and f32 comparisons with
#      the CPU reference and transformers' fixtures, unaligned restores and capsules.
#   2. `flashrt bench` with FLASHRT_GDN_PREP=0 then 1: models/qwen36-35b-a3b.toml at 2048 and
#      16384 tokens (issue 16's cold TTFT), models/qwen36-27b.toml at 16384 (issue 13's), each
#      with --profile (the prefill chunks' kernels).
#   3. (BAR=1) the bars' 27B command at 16k (issues 13 and 15), as benches/run-slack-h200.sh.
#
# Built here first (git-ignored .gpu/, carried packed in .gpupack/p.tar.xz):
#   cargo build --release --features cuda && strip --strip-debug target/release/flashrt -o .gpu/flashrt
#   bash scripts/gpu-check.sh --collect
#   tar -cJf .gpupack/p.tar.xz .gpu/bin/cuda_model .gpu/flashrt
#
# Usage (repository root on the GPU machine): [TESTS=0] [BAR=1] [CLIENTS=4] bash benches/run-gdn-prep-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-gdn-prep}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
if [ "${TESTS:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  "$BIN/cuda_model" --test-threads=1 ${TESTLIST:-gdn_chunk_records moe_wide bf16_tracks_cpu_reference \
    bf16_chunked_prefill fixtures_f32 unaligned_restore capsules_on_gpu} \
    >"$OUT/cuda_model.log" 2>&1 || status=1
  grep -hE '^test |test result|bit-identical|panicked' "$OUT/cuda_model.log"
fi
for m in ${MODELS:-qwen36-35b-a3b:2048,16384 qwen36-27b:16384}; do
  for v in ${PREPS:-0 1}; do
    n=${m%%:*}-prep$v
    FLASHRT_GDN_PREP=$v timeout 300 "$FLASHRT" bench "$ROOT/models/${m%%:*}.toml" --random-weights \
      --backend cuda --lengths "${m##*:}" --iters 2 --decode-steps 16 --profile \
      --json "$OUT/$n.json" >"$OUT/$n.log" 2>&1 || status=1
    echo "== $n"
    grep -E '^ +(2048|16384) ' "$OUT/$n.log" | head -2
    grep -E 'gated_deltanet|chunk records|profile: prefill' "$OUT/$n.log" | head -6
  done
done
[ "${BAR:-0}" = 1 ] || exit $status
bar16k
exit $status
