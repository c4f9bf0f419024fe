#!/usr/bin/env bash
# The stream-K tensor-core gemv (kernels/gemv_mma.cu) on the GPU machine in ONE command:
#
#   1. the kernel microbenchmark (benches/kernels/gemvm_micro.cu, built here into
#      .gpu/bin/gemvm_micro): tensor cores vs CUDA cores at 1/2/4/8 rows on the 27B shape's
#      decode matrices, bf16 and FP8, next to a plain read of the same bytes;
#   2. the GPU tests the kernel touches (cuda_ops linear/gemv/fp8, cuda_model batched and
#      speculative steps, cuda_fp8);
#   3. `flashrt bench --batch 1,2,4,8` on the Qwen3.6-27B shape with the CUDA-core gemv
#      (FLASHRT_GEMV16_MMA=0) and with the tensor-core gemv (=1, with `--serve`: 8 HTTP clients,
#      suffixes after a stored prefix), then the FP8 model's decode (gemv8m).
#
# Usage (repository root on the GPU machine; binaries built here): bash benches/run-gemvm-h200.sh OUT
# Environment: TESTS=0 skips step 2, MICRO=0 step 1.
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-gemvm}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/.gpu/flashrt"
M="$ROOT/models/qwen36-27b.toml"
mkdir -p "$OUT"
export FLASHRT_FIXTURES="$ROOT/tests/fixtures" RUST_BACKTRACE=1
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
}
status=0
if [ "${MICRO:-1}" != 0 ]; then
  timeout 90 "$ROOT/.gpu/bin/gemvm_micro" >"$OUT/micro.log" 2>&1 || status=1
  cat "$OUT/micro.log"
fi
if [ "${TESTS:-1}" != 0 ]; then
  {
    timeout 150 "$ROOT/.gpu/bin/cuda_ops" --test-threads=1 linear gemv fp8 2>&1
    timeout 200 "$ROOT/.gpu/bin/cuda_model" --test-threads=1 batched_decode short_suffixes speculative_greedy \
      gemv_tiles 2>&1
    timeout 120 "$ROOT/.gpu/bin/cuda_fp8" --test-threads=1 2>&1
  } >"$OUT/tests.log" || status=1
  grep -hE '^test |test result|panicked' "$OUT/tests.log" | grep -v ' ok$'
fi
FLASHRT_GEMV16_MMA=0 timeout 120 "$BIN" bench "$M" --random-weights --backend cuda --lengths 2048 --iters 2 \
  --decode-steps 24 --batch 1,2,4,8 --json "$OUT/bench-cores.json" >"$OUT/bench-cores.log" 2>&1 || status=1
echo "== CUDA-core gemv"; grep -vE ' INFO |^\[|WARN' "$OUT/bench-cores.log" | tail -14
FLASHRT_GEMV16_MMA=1 timeout 200 "$BIN" bench "$M" --random-weights --backend cuda --lengths 2048,16384 --iters 2 \
  --decode-steps 24 --batch 1,2,4,8 --serve --serve-suffixes 1,32,256 --serve-runs 2 --serve-clients 8 \
  --json "$OUT/bench-mma.json" >"$OUT/bench-mma.log" 2>&1 || status=1
echo "== tensor-core gemv"; grep -vE ' INFO |^\[|WARN' "$OUT/bench-mma.log" | tail -40
timeout 100 "$BIN" bench "$M" --random-weights --backend cuda --quantize fp8 --lengths 2048 --iters 2 \
  --decode-steps 24 --batch 1,8 --json "$OUT/bench-fp8.json" >"$OUT/bench-fp8.log" 2>&1 || status=1
echo "== FP8 (gemv8m)"; grep -vE ' INFO |^\[|WARN' "$OUT/bench-fp8.log" | tail -14
exit $status
