#!/usr/bin/env bash
# A stored prompt's short suffix (issue 13's "+32" bar), one device call:
#   1. GPU tests: cuda_ops `attention` (the packed and unpacked warpgroup-MMA prefill kernel
#      against the CPU reference), cuda_fp8, cuda_sample and cuda_model whole (every model's
#      prefill takes the grouped projections, `CudaOptions::linear_group`);
#   2. `flashrt bench` on the 27B shape at 16384 with `--profile-rows 32,64` (cold TTFT, the
#      32- and 64-row suffixes after the stored prompt, unprofiled and profiled) in one binary:
#      `sep` with FLASHRT_LINEAR_GROUP=0 FLASHRT_ATTN_PACK=0 (as before both changes), `grp`
#      with the grouped projections only, `new` as it ships (both).
# Usage (repository root on the GPU machine, carry .gpupack/p.tar.xz):
#   OUT=DIR bash benches/run-suffix-h200.sh
set -uo pipefail
OUT="${OUT:-benches/results/latest-suffix}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
head -1 "$OUT/device.txt"
timeout 120 "$BIN/cuda_ops" attention --test-threads=1 >"$OUT/cuda_ops.log" 2>&1 || status=1
timeout 60 "$BIN/cuda_fp8" --test-threads=1 >"$OUT/cuda_fp8.log" 2>&1 || status=1
timeout 60 "$BIN/cuda_sample" --test-threads=1 >"$OUT/cuda_sample.log" 2>&1 || status=1
timeout 240 "$BIN/cuda_model" --test-threads=1 >"$OUT/cuda_model.log" 2>&1 || status=1
grep -hE 'test result|panicked|FAILED' "$OUT"/cuda_*.log
env_of() {
  case "$1" in
    sep) echo FLASHRT_LINEAR_GROUP=0 FLASHRT_ATTN_PACK=0 ;;
    grp) echo FLASHRT_LINEAR_GROUP=1 FLASHRT_ATTN_PACK=0 ;;
    *) echo FLASHRT_LINEAR_GROUP=1 FLASHRT_ATTN_PACK=1 ;;
  esac
}
for v in ${VARIANTS:-sep grp new}; do
  # shellcheck disable=SC2046
  run_bench "s27-$v" "$FLASHRT" $(env_of "$v") -- "$ROOT/models/qwen36-27b.toml" --iters 1 \
    --lengths 16384 --decode-steps 4 --profile-rows 32,64
  grep -E "cold TTFT|suffix at" "$OUT/s27-$v.log" | head -5
done
exit $status
