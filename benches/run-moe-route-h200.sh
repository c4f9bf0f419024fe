#!/usr/bin/env bash
# The 2026-12-06 11:39 UTC session's GPU check: a small phase's MoE routing inside its up
# launch (`CudaOptions::moe_route_in_up`, kernels/moe.cu `moe_up_routed`), A/B against the
# separate `moe_route` launch. One device call:
#
#   1. cuda_model: its bit-identity test, the batched-decode test (now with the MoE model), the
#      earlier bit-identity tests, the comparisons with the CPU reference and transformers'
#      fixtures, unaligned restores and capsules.
#   2. `flashrt bench` models/qwen36-35b-a3b.toml decode at 2048 tokens (batch 1; BATCH=1,8 where the card holds eight sessions) with
#      FLASHRT_MOE_ROUTE_IN_UP=0 then 1 then 0 again, and once with --profile (the decode
#      step's kernels).
#   3. (COLD=1, default) `flashrt bench` on models/qwen36-35b-a3b.toml at 2048 and 16384 tokens
#      and on models/qwen36-27b.toml at 2048, default options.
#   4. (BAR=1) the bars' 27B command at 16k (issues 13 and 15), as benches/run-slack-h200.sh.
#
# Built here first (git-ignored .gpu/, carried packed in .gpupack/p.tar.xz):
#   cargo build --release --features cuda && strip --strip-debug target/release/flashrt -o .gpu/flashrt
#   bash scripts/gpu-check.sh --collect
#   tar -cJf .gpupack/p.tar.xz .gpu/bin/cuda_model .gpu/flashrt
#
# Usage (repository root on the GPU machine): [TESTS=0] [BAR=1] [CLIENTS=4] bash benches/run-moe-route-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-moe-route}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
if [ "${TESTS:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  "$BIN/cuda_model" --test-threads=1 ${TESTLIST:-moe_routing batched_decode gdn_chunk_records moe_wide \
    bf16_tracks_cpu_reference bf16_chunked_prefill fixtures_f32 unaligned_restore capsules_on_gpu \
    short_suffixes speculative} >"$OUT/cuda_model.log" 2>&1 || status=1
  grep -hE '^test |test result|bit-identical|panicked' "$OUT/cuda_model.log"
fi
# RUNS: BINARY:ROUTE[:VARIANT] (VARIANT: FLASHRT_MOE_VARIANT, the switch of the binaries measured in
# benches/results/2026-12-06-h100-moe-route/r4-*, r5-*, since removed), BINARY a file under .gpu/ (e.g. an earlier build carried beside it).
for run in ${RUNS:-flashrt:0 flashrt:1 flashrt:0 flashrt:1}; do
  IFS=: read -r b v x <<<"$run"
  n=35b-$b-route$v${x:+-v$x}-$((i = ${i:-0} + 1))
  FLASHRT_MOE_VARIANT=${x:-7} FLASHRT_MOE_ROUTE_IN_UP=$v timeout 200 "$ROOT/.gpu/$b" bench "$ROOT/models/qwen36-35b-a3b.toml" --random-weights \
    --backend cuda --lengths 2048 --iters 1 --decode-steps 64 --batch "${BATCH:-1}" \
    --json "$OUT/$n.json" >"$OUT/$n.log" 2>&1 || status=1
  echo "== $n"
  grep -E '^ +2048 ' "$OUT/$n.log" | head -3
done
for v in ${PROFILES:-1}; do
  n=35b-route$v-profile
  FLASHRT_MOE_ROUTE_IN_UP=$v timeout 200 "$FLASHRT" bench "$ROOT/models/qwen36-35b-a3b.toml" --random-weights \
    --backend cuda --lengths 2048 --iters 1 --decode-steps 16 --profile \
    --json "$OUT/$n.json" >"$OUT/$n.log" 2>&1 || status=1
  echo "== $n"
  sed -n '/profile: decode/,/^$/p' "$OUT/$n.log" | head -24
done
if [ "${COLD:-1}" = 1 ]; then
  # Both models' headline rows with the default options (issue 16's cold TTFT, the 27B beside it).
  timeout 300 "$FLASHRT" bench "$ROOT/models/qwen36-35b-a3b.toml" --random-weights --backend cuda \
    --lengths 2048,16384 --iters 2 --decode-steps 32 --json "$OUT/35b.json" >"$OUT/35b.log" 2>&1 || status=1
  echo "== 35b"
  grep -E '^ +(2048|16384) ' "$OUT/35b.log" | head -2
  bench27 27b -- --lengths 2048 --iters 1 --decode-steps 32 --batch 1
fi
[ "${BAR:-0}" = 1 ] || exit $status
bar16k
exit $status
