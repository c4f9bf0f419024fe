#!/usr/bin/env bash
# Prefill matmuls over one input as one GEMM (`CudaOptions::linear_group`, flashrt-ir's
# `scratch_cols`: a Gated DeltaNet layer's four input projections, attention's q / k / v, an MLP's
# gate and up), one device call:
#   1. cuda_fp8, cuda_sample and cuda_model whole (every model's prefill takes the grouped GEMMs
#      and reads the projections through strided views);
#   2. `flashrt bench` with `.gpu/flashrt-base` (the binary before the change, when carried),
#      this one with FLASHRT_LINEAR_GROUP=0 and as it ships: the 27B shape at 16384 with
#      `--profile-rows 32,64` (cold TTFT, the stored-prompt suffixes unprofiled and profiled)
#      and the 35B-A3B shape's cold TTFT at 2048 and 16384.
# Usage (repository root on the GPU machine, carry .gpupack/p.tar.xz):
#   OUT=DIR bash benches/run-linear-group-h200.sh
set -uo pipefail
OUT="${OUT:-benches/results/latest-linear-group}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
head -1 "$OUT/device.txt"
timeout 100 "$BIN/cuda_fp8" --test-threads=1 >"$OUT/cuda_fp8.log" 2>&1 || status=1
timeout 60 "$BIN/cuda_sample" --test-threads=1 >"$OUT/cuda_sample.log" 2>&1 || status=1
timeout 260 "$BIN/cuda_model" --test-threads=1 >"$OUT/cuda_model.log" 2>&1 || status=1
grep -hE 'test result|panicked|FAILED' "$OUT"/cuda_*.log
# base: the binary before the change (when carried); sep: this binary with the groups off
# (FLASHRT_LINEAR_GROUP=0: the new layout's column views, one matmul per projection); new:
# this binary as it ships.
bin_of() { if [ "$1" = base ]; then echo "$ROOT/.gpu/flashrt-base"; else echo "$FLASHRT"; fi; }
env_of() { if [ "$1" = sep ]; then echo FLASHRT_LINEAR_GROUP=0; else echo FLASHRT_LINEAR_GROUP=1; fi; }
variants=(sep new)
[ -x "$ROOT/.gpu/flashrt-base" ] && variants=(base sep new)
for v in "${variants[@]}"; do
  run_bench "s27-$v" "$(bin_of "$v")" "$(env_of "$v")" -- "$ROOT/models/qwen36-27b.toml" --iters 1 \
    --lengths 16384 --decode-steps 4 --profile-rows 32,64
  grep -E "cold TTFT|suffix at" "$OUT/s27-$v.log" | head -5
done
for v in "${variants[@]}"; do
  run_bench "c35-$v" "$(bin_of "$v")" "$(env_of "$v")" -- "$ROOT/models/qwen36-35b-a3b.toml" \
    --iters 1 --lengths 2048,16384 --decode-steps 8
  grep -E "cold TTFT" "$OUT/c35-$v.log" | head -3
done
exit $status
