#!/usr/bin/env bash
# GPU check of the 2026-12-06 13:50 UTC session's attention-layer fusions (built without a
# device, off by default until this runs): `CudaOptions::qk_prep` (FLASHRT_QK_PREP=1: the
# query / gate split, q and k norms, rotations and cache write as one launch,
# kernels/norm_qk.cu) and `CudaOptions::attn_gate` (FLASHRT_ATTN_GATE=1: the output gate in
# the small-phase attention's stores, kernels/attention_decode.cu `dec_store4`). Also the first
# GPU run of that session's plan change (q, k and v projections adjacent: one gemv launch).
# One device call:
#
#   1. cuda_model: the fusions' bit-identity test (bf16 and f32, with and without MTP, the
#      LFM2 fixture's config), the batched-decode test (a case with both on), and the
#      comparisons with the CPU reference and transformers' fixtures, capsules, unaligned
#      restores, speculative decoding.
#   2. `flashrt bench` decode at 2048 tokens on models/qwen36-27b.toml and
#      models/qwen36-35b-a3b.toml with the fusions off / on / off / on (alternated; RUNS
#      lists MODEL:QK:GATE), then --profile with both on for each model (PROFILES=1).
#   3. (BAR=1) the bars' 27B command at 16k (issues 13 and 15) with the fusions on.
#
# Built here first (git-ignored .gpu/, carried packed in .gpupack/p.tar.xz):
#   cargo build --release --features cuda && strip --strip-debug target/release/flashrt -o .gpu/flashrt
#   bash scripts/gpu-check.sh --collect
#   tar -cJf .gpupack/p.tar.xz .gpu/bin/cuda_model .gpu/flashrt
#
# Usage (repository root on the GPU machine): [TESTS=0] [PROFILES=0] [BAR=1] bash benches/run-attn-fusions-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-attn-fusions}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
if [ "${TESTS:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  "$BIN/cuda_model" --test-threads=1 ${TESTLIST:-attention_fusions batched_decode bf16_tracks_cpu_reference \
    bf16_chunked_prefill fixtures_f32 unaligned_restore capsules_on_gpu short_suffixes speculative} \
    >"$OUT/cuda_model.log" 2>&1 || status=1
  grep -hE '^test |test result|bit-identical|panicked' "$OUT/cuda_model.log"
fi
model_file() { case "$1" in 27b) echo qwen36-27b.toml ;; *) echo qwen36-35b-a3b.toml ;; esac; }
for run in ${RUNS:-27b:0:0 27b:1:1 27b:0:0 27b:1:1 35b:0:0 35b:1:1 35b:0:0 35b:1:1}; do
  IFS=: read -r m q g <<<"$run"
  n=$m-qk$q-gate$g-$((i = ${i:-0} + 1))
  FLASHRT_QK_PREP=$q FLASHRT_ATTN_GATE=$g timeout 240 "$FLASHRT" bench "$ROOT/models/$(model_file "$m")" \
    --random-weights --backend cuda --lengths 2048 --iters 1 --decode-steps 64 --batch 1 \
    --json "$OUT/$n.json" >"$OUT/$n.log" 2>&1 || status=1
  echo "== $n"
  grep -E '^ +2048 ' "$OUT/$n.log" | head -3
done
if [ "${PROFILES:-1}" = 1 ]; then
  for m in 27b 35b; do
    n=$m-fused-profile
    FLASHRT_QK_PREP=1 FLASHRT_ATTN_GATE=1 timeout 240 "$FLASHRT" bench "$ROOT/models/$(model_file "$m")" \
      --random-weights --backend cuda --lengths 2048 --iters 1 --decode-steps 16 --profile \
      --json "$OUT/$n.json" >"$OUT/$n.log" 2>&1 || status=1
    echo "== $n"
    sed -n '/profile: decode/,/^$/p' "$OUT/$n.log" | head -24
  done
fi
[ "${BAR:-0}" = 1 ] || exit $status
export FLASHRT_QK_PREP=1 FLASHRT_ATTN_GATE=1
bar16k
exit $status
