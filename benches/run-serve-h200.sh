#!/usr/bin/env bash
# Issues 13 and 15 (the served path, the scheduler) on the GPU machine in ONE command, so every
# figure of their RESULTS.md sections comes from one run:
#
#   1. GPU tests of what the served path relies on: cuda_model (verify passes equal decode
#      steps bit for bit, speculative = plain, shared arenas, unaligned restores) and
#      cuda_sample (the device sampler against the host's);
#   2. `flashrt bench --serve` on the Qwen3.6-27B shape (random bf16 weights): the engine's
#      cold / restored TTFT and decode step, then through HTTP the TTFT after a stored prefix
#      plus each suffix (with the steps the chunk planner chose and the plan costs it measured
#      at start-up), an exact repeat, streamed decode greedy / sampled / speculative, 8 clients
#      at once against each alone, and a 16k-token prompt arriving while they stream;
#   3. the plan costs (the `chunk planner:` line: decode, verify[1..4], every prefill bucket)
#      and decode step with each candidate switch on (FLASHRT_GEMV_TILES=1: verify rows' gemv
#      launches as resident blocks looping over tiles), and with every other binary
#      `.gpu/flashrt-<variant>` (a candidate kernel built here).
#
# Usage (repository root on the GPU machine; binaries built here: `cargo build --release
# --features cuda`, `bash scripts/gpu-check.sh --collect`, `strip -o .gpu/flashrt
# target/release/flashrt`):
#   bash benches/run-serve-h200.sh [OUT_DIR]
# Environment: LENGTHS (default 2048,16384), TESTS=0 skips step 1, CLIENTS (default 8),
# NEWCOMER (default 16384), SUFFIXES (default 1,2,4,8,32,64,65,256,1024).
set -uo pipefail

OUT="${1:-${OUT:-benches/results/latest-serve}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LENGTHS="${LENGTHS:-2048,16384}"
SUFFIXES="${SUFFIXES:-1,2,4,8,32,64,65,256,1024}"
mkdir -p "$OUT"
export FLASHRT_FIXTURES="$ROOT/tests/fixtures" RUST_BACKTRACE=1

{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
} | tee "$OUT/device.txt"

status=0
if [ "${TESTS:-1}" != 0 ]; then
  "$ROOT/.gpu/bin/cuda_model" --test-threads=1 --nocapture \
    short_suffixes speculative_greedy sessions_share unaligned gemv_tiles >"$OUT/cuda_model.log" 2>&1 || status=1
  "$ROOT/.gpu/bin/cuda_sample" --test-threads=1 >"$OUT/cuda_sample.log" 2>&1 || status=1
  # The candidate switch keeps every row's arithmetic: the same tests, bit-exact ones included.
  FLASHRT_GEMV_TILES=1 "$ROOT/.gpu/bin/cuda_model" --test-threads=1 --nocapture \
    short_suffixes speculative_greedy >"$OUT/cuda_model-gemv-tiles.log" 2>&1 || status=1
  FLASHRT_GEMV_TILES=1 "$ROOT/.gpu/bin/cuda_ops" --test-threads=1 linear gemv_groups \
    >"$OUT/cuda_ops-gemv-tiles.log" 2>&1 || status=1
  grep -hE '^test |test result' "$OUT"/cuda_*.log
fi

"$ROOT/.gpu/flashrt" bench "$ROOT/models/qwen36-27b.toml" --random-weights --backend cuda \
  --lengths "$LENGTHS" --iters 5 --decode-steps 48 --serve --serve-suffixes "$SUFFIXES" \
  --serve-runs 3 --serve-clients "${CLIENTS:-8}" --serve-newcomer "${NEWCOMER:-16384}" \
  --json "$OUT/bench.json" >"$OUT/bench.log" 2>&1 || status=1
grep -E 'chunk planner|TTFT|streamed decode|clients at once|prompt while' "$OUT/bench.log" \
  | grep -v ' INFO ' | tail -40

short_run() { # binary, name
  "$1" bench "$ROOT/models/qwen36-27b.toml" --random-weights --backend cuda --lengths 2048 \
    --iters 3 --decode-steps 32 --serve --serve-suffixes 1,2,4,32 --serve-runs 3 \
    --json "$OUT/bench-$2.json" >"$OUT/bench-$2.log" 2>&1 || status=1
  echo "== $2"
  grep -E 'chunk planner|decode|TTFT' "$OUT/bench-$2.log" | grep -v ' INFO ' | tail -12
}
FLASHRT_GEMV_TILES=1 short_run "$ROOT/.gpu/flashrt" gemv-tiles
for bin in "$ROOT"/.gpu/flashrt-*; do
  [ -x "$bin" ] || continue
  short_run "$bin" "$(basename "$bin")"
done
exit $status
