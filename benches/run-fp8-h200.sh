#!/usr/bin/env bash
# Issue 17 (FP8 weights) on the GPU machine, in ONE command, so the FP8 and bf16 figures in
# benches/RESULTS.md come from the same run:
#
#   1. the FP8 GPU tests (cuda_fp8: fixtures f32 vs transformers, bf16 vs the CPU reference,
#      the device quantizer against the FP8 checkpoint, a random 128x128-block model with W8A8
#      prefill) and cuda_ops' FP8 and gemv cases;
#   2. `flashrt bench` on the Qwen3.6-27B shape, random weights generated on the device, in
#      bf16 and then with `--quantize fp8` (E4M3, 128x128 blocks, the matrices Qwen's FP8
#      releases keep in bf16 kept so): decode step next to its byte floor, cold TTFT next to
#      the FLOP floor (the FP8 matmuls at the FP8 rate measured in the same run), restored
#      TTFT; per-kernel profiles of the FP8 run.
#
# Usage (repository root on the GPU machine; binaries built here: `cargo build --release
# --features cuda`, `bash scripts/gpu-check.sh --collect`, `cp target/release/flashrt .gpu/`):
#   bash benches/run-fp8-h200.sh [OUT_DIR]
# Environment: LENGTHS (default 2048,16384), TESTS=0 skips step 1, BF16=0 / FP8=0 skip a bench,
# OPS_TESTS filters cuda_ops (default: its FP8, gemv and linear cases).
set -uo pipefail

OUT="${1:-${OUT:-benches/results/latest-fp8}}"
LENGTHS="${LENGTHS:-2048,16384}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/.gpu/flashrt"
mkdir -p "$OUT"
export FLASHRT_FIXTURES="$ROOT/tests/fixtures" RUST_BACKTRACE=1

{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$OUT/device.txt"

status=0
if [ "${TESTS:-1}" != 0 ]; then
  "$ROOT/.gpu/bin/cuda_fp8" --test-threads=1 --nocapture >"$OUT/cuda_fp8.log" 2>&1 || status=1
  "$ROOT/.gpu/bin/cuda_ops" --test-threads=1 --nocapture ${OPS_TESTS:-fp8 gemv_groups_and_glu linear} \
    >"$OUT/cuda_ops.log" 2>&1 || status=1
  grep -E '^test |test result|rel err|panicked' "$OUT/cuda_fp8.log" "$OUT/cuda_ops.log" | tail -40
fi

if [ "${BF16:-1}" != 0 ]; then
  "$BIN" bench "$ROOT/models/qwen36-27b.toml" --random-weights --backend cuda \
    --lengths "$LENGTHS" --json "$OUT/bench-27b-bf16.json" >"$OUT/bench-27b-bf16.log" 2>&1 || status=1
  tail -6 "$OUT/bench-27b-bf16.log"
fi
if [ "${FP8:-1}" != 0 ]; then
  "$BIN" bench "$ROOT/models/qwen36-27b.toml" --random-weights --backend cuda --quantize fp8 \
    --lengths "$LENGTHS" --profile --json "$OUT/bench-27b-fp8.json" >"$OUT/bench-27b-fp8.log" 2>&1 || status=1
  grep -v '^\[bench\]' "$OUT/bench-27b-fp8.log" | head -60
fi
exit $status
