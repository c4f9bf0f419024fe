#!/usr/bin/env bash
# GPU check of the gemv tiles' reduction with half the values exchanged per shuffle stage
# (kernels/common.cuh `warp_sum_many`, kernels/gemv.cu `GEMV_REDUCE_MANY`; the same bits as one
# warp_sum per value, off by default until this runs), one device call:
#
#   1. GPU tests on the NEW build: cuda_ops `linear`, `gemv_groups_and_glu`, `fp8_linear`
#      (against the CPU reference); cuda_model `bf16_tracks_cpu_reference`,
#      `fixtures_f32_match_transformers`, the batched-decode test, short suffixes as verify
#      passes, speculative decoding.
#   2. `flashrt bench --batch 1,2,4,8` at 2048 on models/qwen36-27b.toml, BASE and NEW
#      alternated; then both with `--quantize fp8` at one row (the FP8 step's CUDA-core gemv8
#      launches), and the 35B-A3B shape at one row.
#
# Built here and carried packed (the working tree plus carry must stay under 64 MiB, so only
# these binaries):
#   cargo build --release --features cuda && strip --strip-debug target/release/flashrt -o .gpu/flashrt2
#   tar -cJf .gpupack/v2.tar.xz .gpu/flashrt2                                   # BASE
#   FLASHRT_NVCC_FLAGS=-DGEMV_REDUCE_MANY=1 cargo build --release --features cuda
#   strip --strip-debug target/release/flashrt -o .gpu/flashrt3
#   FLASHRT_NVCC_FLAGS=-DGEMV_REDUCE_MANY=1 bash scripts/gpu-check.sh --collect
#   cp .gpu/bin/cuda_model .gpu/cuda_model3 && cp .gpu/bin/cuda_ops .gpu/cuda_ops3
#   tar -cJf .gpupack/v3.tar.xz .gpu/flashrt3 .gpu/cuda_model3 .gpu/cuda_ops3   # NEW
# Usage (repository root on the GPU machine, carry .gpupack): [REPS=2] bash benches/run-gemv-reduce-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-gemv-reduce}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
for f in v2 v3; do tar -xJf "$ROOT/.gpupack/$f.tar.xz" -C "$ROOT"; done
BASE="$ROOT/.gpu/flashrt2" NEW="$ROOT/.gpu/flashrt3"
"$ROOT/.gpu/cuda_ops3" --test-threads=1 linear gemv_groups_and_glu fp8_linear >"$OUT/cuda_ops.log" 2>&1 || status=1
"$ROOT/.gpu/cuda_model3" --test-threads=1 bf16_tracks_cpu_reference fixtures_f32 batched_decode short_suffixes \
  speculative_greedy >"$OUT/cuda_model.log" 2>&1 || status=1
grep -hE '^test |test result|panicked' "$OUT/cuda_ops.log" "$OUT/cuda_model.log"
b() {
  run_bench "$1" "$2" -- "${@:3}" --iters 1 --lengths 2048
  grep -E '^ +2048 +[1248] ' "$OUT/$1.log" | head -4
}
M27="$ROOT/models/qwen36-27b.toml"
for i in $(seq "${REPS:-2}"); do
  b base-batch-$i "$BASE" "$M27" --decode-steps 32 --batch 1,2,4,8
  b new-batch-$i "$NEW" "$M27" --decode-steps 32 --batch 1,2,4,8
done
b base-fp8 "$BASE" "$M27" --quantize fp8 --decode-steps 64 --batch 1
b new-fp8 "$NEW" "$M27" --quantize fp8 --decode-steps 64 --batch 1
b base-35b "$BASE" "$ROOT/models/qwen36-35b-a3b.toml" --decode-steps 64 --batch 1
b new-35b "$NEW" "$ROOT/models/qwen36-35b-a3b.toml" --decode-steps 64 --batch 1
# Where a 2-row step's extra time goes (issue 15's b = 2 bar): its commands and a one-row step's, timed.
run_bench new-profile2 "$NEW" -- "$M27" --iters 1 --lengths 2048 --decode-steps 16 --batch 1,2 --profile
grep -E '^profile:' "$OUT/new-profile2.log"
# On an H200 (the bars' device), also issue 16's cold TTFT of the 35B-A3B shape at 2k and 16k.
if grep -q H200 "$OUT/device.txt"; then
  run_bench h200-35b-cold "$NEW" -- "$ROOT/models/qwen36-35b-a3b.toml" --lengths 2048,16384 --iters 2 --decode-steps 32
  grep -E '^ +(2048|16384) ' "$OUT/h200-35b-cold.log"
fi
exit $status
