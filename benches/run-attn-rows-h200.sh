#!/usr/bin/env bash
# Batched steps' attention decode with each (KV head, split) block running the step's rows one
# after another (kernels/attention_decode.cu `attention_decode_rows_d*`, CudaOptions::attn_rows)
# against a block per (head, split, row) (`FLASHRT_ATTN_ROWS=0`). One device call, one binary.
#   1. GPU tests: batched rows bit-identical to single steps (both attention forms, every gemv
#      kind), the attention fusions (the one-row kernel's merge, now shared), capsules, bf16 and
#      f32 against the references, short suffixes, speculative decoding.
#   2. `flashrt bench --batch 1,2,4,8` at 2048 on models/qwen36-27b.toml, rows on / off, with the
#      CUDA-core gemv (default) and the tensor-core gemv (`FLASHRT_GEMV16_MMA=1`), alternated.
#   3. FLASHRT_PREFETCH_NEXT_MB=16 (27B) and 0 / 8 (35B-A3B at one row); the default's 8-row
#      step profiled; LONG=1: batches 1-8 at 16384 for both gemv kinds.
# Usage (repository root on the GPU machine, carry .gpupack):
#   [REPS=1] [LONG=1] [PROFILE=1] [TESTS="names"] bash benches/run-attn-rows-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-attn-rows}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
# shellcheck disable=SC2086
"$BIN/cuda_model" --test-threads=1 ${TESTS:-batched_decode attention_fusions bf16_tracks_cpu_reference speculative_greedy \
  capsules_on_gpu fixtures_f32 short_suffixes unaligned_restore} >"$OUT/cuda_model.log" 2>&1 || status=1
echo "== tests"; grep -hE 'test result|panicked|FAILED' "$OUT/cuda_model.log"
M27="$ROOT/models/qwen36-27b.toml"
for i in $(seq "${REPS:-1}"); do
  batch27 rows-$i
  batch27 perrow-$i FLASHRT_ATTN_ROWS=0
  batch27 mma-rows-$i FLASHRT_GEMV16_MMA=1
  batch27 mma-perrow-$i FLASHRT_GEMV16_MMA=1 FLASHRT_ATTN_ROWS=0
done
# The next matmul's weights asked of the L2 by the launches before it (CudaOptions::prefetch_next):
# 16 MiB at most, a quarter of the matrix at most, none in batched steps (the builder's rule).
batch27 pf16 FLASHRT_PREFETCH_NEXT_MB=16
for pf in 0 16; do
  run_bench "35b-pf$pf" "$FLASHRT" FLASHRT_PREFETCH_NEXT_MB=$pf -- "$ROOT/models/qwen36-35b-a3b.toml" --iters 1 \
    --lengths 2048 --decode-steps 64 --batch 1
  grep -E '^ +2048 +1 ' "$OUT/35b-pf$pf.log"
done
[ "${PROFILE:-1}" = 1 ] && run_bench profile8 "$FLASHRT" -- "$M27" --iters 1 --lengths 2048 --decode-steps 16 --batch 8 --profile
awk '/^profile: decode\[8\]/{p=1} /^profile: prefill/{p=0} p' "$OUT/profile8.log" | head -14
if [ "${LONG:-0}" = 1 ]; then
  for v in "" FLASHRT_GEMV16_MMA=1; do
    n="16k${v:+-mma}"
    run_bench "$n" "$FLASHRT" $v -- "$M27" --iters 1 --lengths 16384 --decode-steps 16 --batch 1,2,4,8
    grep -E '^ +16384 +[1248] ' "$OUT/$n.log" | head -4
  done
fi
exit $status
