#!/usr/bin/env bash
# The GPU half of the 2026-12-05 21:20 UTC session's work (built and checked on the CPU first:
# benches/RESULTS.md), one device call of under 600 s (~500 s):
#
#   1. the CUDA test suites but cuda_ops (scripts/gpu-check.sh; the pack leaves cuda_ops out:
#      no op changed), among them `capsules_on_gpu`, whose restore into the session that took
#      the capsule now skips the KV rows it holds;
#   2. the served path at 2k and 16k (stored prefix + 1 / + 32, exact repeat, streamed decode)
#      with restores skipping held rows (the default), and at 16k copying every row
#      (`FLASHRT_RESTORE_REUSE=0`): issue 13's "stored 16k + 1 <= 15 ms". Both have the
#      token-id prompt fast path (parse_ms in the server timings);
#   3. (STORE=1, the default) 4 clients streaming at 16k while a 16k newcomer arrives, the
#      device tier held to 4G so 1.2 GiB capsules move down the tiers, with the demotion job's
#      phases logged (its read-back now into host buffers populated up front, huge pages
#      asked for): issue 15's "16k prompt while 4 stream" bar and the worker's wait per store.
#
# Built here first (git-ignored .gpu/, carried packed in .gpupack/p.tar.xz):
#   cargo build --release --features cuda && strip --strip-debug target/release/flashrt -o .gpu/flashrt
#   bash scripts/gpu-check.sh --collect
#   tar -cJf .gpupack/p.tar.xz --exclude=.gpu/bin/cuda_ops .gpu/bin .gpu/flashrt
#
# Usage (repository root on the GPU machine): bash benches/run-restore-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-restore}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
if [ "${MINI:-0}" = 1 ]; then
  # What fits a short device call: the capsule and speculative GPU tests, the 16k served path
  # with and without the held rows.
  "$BIN/cuda_model" --test-threads=1 capsules_on_gpu speculative >"$OUT/cuda_model.log" 2>&1 || status=1
  grep -E '^test |test result' "$OUT/cuda_model.log"
  bench27 serve-mini -- --lengths 16384 --iters 1 --decode-steps 16 --batch 1 --serve \
    --serve-suffixes 1,32 --serve-runs 3
  bench27 serve-mini-reuse-0 FLASHRT_RESTORE_REUSE=0 -- --lengths 16384 --iters 1 \
    --decode-steps 16 --batch 1 --serve --serve-suffixes 1 --serve-runs 3
  exit $status
fi
if [ "${TESTS:-1}" = 1 ]; then
  OUT="$OUT/gpu-check" bash "$ROOT/scripts/gpu-check.sh" >"$OUT/gpu-check.log" 2>&1 || status=1
  tail -8 "$OUT/gpu-check.log"
fi
bench27 serve-reuse-1 -- --lengths 2048,16384 --iters 1 --decode-steps 16 --batch 1 --serve \
  --serve-suffixes 1,32 --serve-runs 3
bench27 serve-reuse-0 FLASHRT_RESTORE_REUSE=0 -- --lengths 16384 --iters 1 --decode-steps 16 \
  --batch 1 --serve --serve-suffixes 1 --serve-runs 3
if [ "${STORE:-1}" = 1 ]; then
  bench27 serve-store RUST_LOG=info,flashrt_runtime::store=debug -- --lengths 16384 --iters 1 \
    --decode-steps 64 --batch 1 --serve --serve-suffixes 1 --serve-runs 3 --serve-clients 4 \
    --serve-newcomer 16384 --serve-budget-device 4G
  grep -E 'clients at once|newcomer|capsule store' "$OUT/serve-store.log" | head -6
  grep -E 'demotion job' "$OUT/serve-store.log" | head -12
fi
exit $status
