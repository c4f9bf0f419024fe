#!/usr/bin/env bash
# The chunked Gated DeltaNet kernel from 32-row buckets (`CudaOptions::gdn_chunk_rows`), one
# device call:
#   1. `flashrt bench` on the 27B shape, a stored prompt of 16384 and of 2048 tokens with
#      `--profile-rows 32,64`, with FLASHRT_GDN_CHUNK_ROWS=64 (`old`: the token kernel for the
#      32-row bucket), as it ships (`new`, 32) and at 16384 with FLASHRT_GDN_PREP=0 (`p0`: a
#      one-chunk call without the separate records launch); VARIANTS_16K / VARIANTS_2K pick;
#   2. GPU tests: cuda_model whole (the bf16 bounds of the token kernel at [8, 16] buckets and of
#      the chunk kernel at 32 and 64 rows), cuda_ops `gated_deltanet` and `attention`.
# Usage (repository root on the GPU machine, carry .gpupack/p.tar.xz):
#   OUT=DIR bash benches/run-gdn32-h200.sh
set -uo pipefail
OUT="${OUT:-benches/results/latest-gdn32}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
head -1 "$OUT/device.txt"
for len in 16384 2048; do
  vs="${VARIANTS_2K:-new}"
  [ "$len" = 16384 ] && vs="${VARIANTS_16K:-old new p0}"
  for v in $vs; do
    case "$v" in
      old) e=FLASHRT_GDN_CHUNK_ROWS=64 ;;
      p0) e=FLASHRT_GDN_PREP=0 ;;
      *) e=FLASHRT_GDN_CHUNK_ROWS=32 ;;
    esac
    BENCH_TIMEOUT=150 run_bench "s$len-$v" "$FLASHRT" "$e" -- "$ROOT/models/qwen36-27b.toml" --iters 1 \
      --lengths "$len" --decode-steps 4 --profile-rows "${ROWS:-32,64}"
    grep -E "cold TTFT|suffix at" "$OUT/s$len-$v.log" | head -5
  done
done
# The tests after the figures (a call cut short keeps the figures).
# MODEL_TESTS / OPS_TESTS: test name filters (default: all of cuda_model; the two op tests).
# shellcheck disable=SC2086
timeout 220 "$BIN/cuda_model" ${MODEL_TESTS:-} --test-threads=1 >"$OUT/cuda_model.log" 2>&1 || status=1
# shellcheck disable=SC2086
timeout 150 "$BIN/cuda_ops" ${OPS_TESTS:-gated_deltanet attention} --test-threads=1 >"$OUT/cuda_ops.log" 2>&1 || status=1
grep -hE 'test result|panicked|FAILED|bf16 logits rel err|prompt logits' "$OUT"/cuda_*.log | head -40
exit $status
