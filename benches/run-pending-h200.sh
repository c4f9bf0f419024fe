#!/usr/bin/env bash
# The GPU half of a build session's checks in ONE command on the GPU machine (results in OUT;
# benches/RESULTS.md, 2026-12-04 15:40 UTC, shows a run of it):
#
#   1. every GPU test suite (scripts/gpu-check.sh; SUITES="cuda_sample cuda_model" runs only
#      those binaries);
#   2. the kernel microbenchmark of the decode matmuls (benches/kernels/gemvm_micro.cu);
#   3. whole steps: `flashrt bench --batch 1,2,4,8` on the 27B shape;
#   4. a speculative round's costs on the 27B shape (per-row states kept: the "kept" column;
#      FLASHRT_ROW_STATES=0 runs without them).
#
# Built here first (git-ignored .gpu/):
#   bash scripts/gpu-check.sh --collect                      # .gpu/bin/cuda_*
#   .venv/nvcc/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels \
#       -L .venv/nvcc/cuda/lib \
#       -o .gpu/extra/gemvm_micro benches/kernels/gemvm_micro.cu
#   cargo build --release --features cuda -p flashrt-runtime --example speculative_costs
#   cargo build --release --features cuda && strip target/release/flashrt -o .gpu/flashrt
#   cp target/release/examples/speculative_costs .gpu/extra/ && strip .gpu/extra/speculative_costs
#   (.gpu/extra, not .gpu/bin: gpu-check.sh runs everything in bin/)
#
# The binaries come to the GPU machine packed (more than the 64 MiB a device call carries
# unpacked): `tar -cJf .gpupack2/gpu.tar.xz .gpu` here (~45 MB), carry `.gpupack2`; the script
# unpacks it when `.gpu/bin` is missing.
#
# Usage (repository root on the GPU machine): bash benches/run-pending-h200.sh OUT
# All of it may pass the 600 s a device call allows: TESTS=0, MICRO=0, BENCH=0, SPEC=0 skip
# parts.
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-pending}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$ROOT/.gpu/bin"
EXTRA="$ROOT/.gpu/extra"
if [ ! -d "$BIN" ] && [ -f "$ROOT/.gpupack2/gpu.tar.xz" ]; then
  tar -xJf "$ROOT/.gpupack2/gpu.tar.xz" -C "$ROOT"
fi
mkdir -p "$OUT"
export FLASHRT_FIXTURES="$ROOT/tests/fixtures" RUST_BACKTRACE=1
status=0
if [ "${TESTS:-1}" != 0 ]; then
  if [ -n "${SUITES:-}" ]; then
    mkdir -p "$ROOT/.gpu/some/bin"
    for b in $SUITES; do cp "$BIN/$b" "$ROOT/.gpu/some/bin/"; done
    OUT="$OUT/tests" bash "$ROOT/scripts/gpu-check.sh" "$ROOT/.gpu/some" >"$OUT/gpu-check.log" 2>&1 || status=1
  else
    OUT="$OUT/tests" bash "$ROOT/scripts/gpu-check.sh" "$ROOT/.gpu" >"$OUT/gpu-check.log" 2>&1 || status=1
  fi
  tail -12 "$OUT/gpu-check.log"
fi
if [ "${MICRO:-1}" != 0 ] && [ -x "$EXTRA/gemvm_micro" ]; then
  timeout 120 "$EXTRA/gemvm_micro" >"$OUT/micro.log" 2>&1 || status=1
  grep -E '^(bf16|fp8)|R=1 |R=8 |invariant' "$OUT/micro.log"
fi
if [ "${BENCH:-1}" != 0 ] && [ -x "$ROOT/.gpu/flashrt" ]; then
  # BENCH_ARGS: more of `flashrt bench`'s options (e.g. --profile, --serve).
  timeout "${BENCH_TIMEOUT:-200}" "$ROOT/.gpu/flashrt" bench "$ROOT/models/qwen36-27b.toml" --random-weights \
    --backend cuda --lengths "${BENCH_LENGTHS:-2048}" --iters 2 --decode-steps 24 --batch 1,2,4,8 \
    ${BENCH_ARGS:-} --json "$OUT/bench.json" >"$OUT/bench.log" 2>&1 || status=1
  echo "== flashrt bench --batch 1,2,4,8"; grep -vE ' INFO |^\[|WARN' "$OUT/bench.log" | tail -14
fi
if [ "${SPEC:-1}" != 0 ] && [ -x "$EXTRA/speculative_costs" ]; then
  FLASHRT_BACKEND=cuda FLASHRT_ROW_STATES=0 timeout 200 "$EXTRA/speculative_costs" --model 27b \
    >"$OUT/spec-replay.log" 2>&1 || status=1
  FLASHRT_BACKEND=cuda timeout 200 "$EXTRA/speculative_costs" --model 27b >"$OUT/spec-kept.log" 2>&1 || status=1
  echo "== speculative round, 27B: restore + replay"; grep -A20 "one round" "$OUT/spec-replay.log"
  echo "== with kept row states"; grep -A20 "one round" "$OUT/spec-kept.log"
fi
exit $status
