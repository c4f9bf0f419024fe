#!/usr/bin/env bash
# Issue 15 (small-batch decoding) on the GPU machine in ONE command:
#
#   1. GPU tests: batched steps bit-identical to one-session steps (cuda_model
#      batched_decode...), and what the batched kernels changed must not move a bit elsewhere
#      (decode/verify/speculative/shared-arena/graph tests, the kernel tests of attention, rope,
#      the KV write and the Gated DeltaNet decode kernel, the device sampler);
#   2. `flashrt bench --batch 1,2,4,8` on the Qwen3.6-27B shape (random bf16 weights) at 2k and
#      16k context, with `--serve`: 8 HTTP clients at once against each alone (the scheduler
#      feeds them in one batched step per round) and a 16k prompt arriving while they stream.
#
# Usage (repository root on the GPU machine; binaries built here: `cargo build --release
# --features cuda`, `bash scripts/gpu-check.sh --collect`, `strip -o .gpu/flashrt
# target/release/flashrt`):
#   bash benches/run-batch-h200.sh [OUT_DIR]
# Environment: LENGTHS (default 2048,16384), TESTS=0 skips step 1, SUFFIXES (default
# 1,4,32,256,1024).
set -uo pipefail

OUT="${1:-${OUT:-benches/results/latest-batch}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LENGTHS="${LENGTHS:-2048,16384}"
mkdir -p "$OUT"
export FLASHRT_FIXTURES="$ROOT/tests/fixtures" RUST_BACKTRACE=1

{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$OUT/device.txt"

status=0
if [ "${TESTS:-1}" != 0 ]; then
  timeout 300 "$ROOT/.gpu/bin/cuda_model" --test-threads=1 --nocapture \
    batched_decode short_suffixes speculative_greedy sessions_share gemv_tiles \
    graphs_replay mtp_phases capsules_on_gpu bf16_tracks_cpu >"$OUT/cuda_model.log" 2>&1 || status=1
  timeout 200 "$ROOT/.gpu/bin/cuda_ops" --test-threads=1 attention linear gemv \
    >"$OUT/cuda_ops.log" 2>&1 || status=1
  timeout 100 "$ROOT/.gpu/bin/cuda_sample" --test-threads=1 >"$OUT/cuda_sample.log" 2>&1 || status=1
  grep -hE '^test |test result|panicked' "$OUT"/cuda_*.log | grep -v ' ok$'
  grep -h 'test result' "$OUT"/cuda_*.log
fi

timeout 420 "$ROOT/.gpu/flashrt" bench "$ROOT/models/qwen36-27b.toml" --random-weights --backend cuda \
  --lengths "$LENGTHS" --iters 3 --decode-steps 32 --batch 1,2,4,8 --serve \
  --serve-suffixes "${SUFFIXES:-1,4,32,256,1024}" --serve-runs 3 --serve-clients 8 \
  --serve-newcomer 16384 --json "$OUT/bench.json" >"$OUT/bench.log" 2>&1 || status=1
grep -vE ' INFO |^\[' "$OUT/bench.log" | tail -75
grep -E 'chunk planner' "$OUT/bench.log"

# The same engine with small phases' 16-bit matmuls on the tensor cores (FLASHRT_GEMV16_MMA=1):
# decode and batched steps.
FLASHRT_GEMV16_MMA=1 timeout 200 "$ROOT/.gpu/flashrt" bench "$ROOT/models/qwen36-27b.toml" \
  --random-weights --backend cuda --lengths 2048 --iters 2 --decode-steps 24 --batch 1,2,4,8 \
  --serve --serve-suffixes 1,4 --serve-runs 2 --serve-clients 8 --json "$OUT/bench-gemv16m.json" >"$OUT/bench-gemv16m.log" 2>&1 || status=1
echo "== FLASHRT_GEMV16_MMA=1"
grep -vE ' INFO |^\[' "$OUT/bench-gemv16m.log" | grep -v WARN | tail -24
exit $status
