#!/usr/bin/env bash
# The 2026-12-06 03:20 UTC session's GPU work, two device calls of under 600 s each:
#
#   PART=tests (~400 s): the whole GPU suite (scripts/gpu-check.sh) on this build — among it
#     `device_argmax_is_the_host_argmax`, the greedy-with-penalties session case and
#     `deferred_logits_read_as_eager_ones_on_gpu` — then `flashrt bench --batch 1 --profile`
#     at 2k (decode step and its profile).
#   PART=serve (~400 s): `host_snapshots_restore_like_device_ones_on_gpu`, the batched decode
#     steps at 2k (rows' host copies deferred), the served path at 16k (stored prefix + 1 and + 32, exact repeat,
#     streamed greedy and sampled decode, the bench's decode step) with greedy tokens drawn on
#     the device from a row whose host copy is deferred (the default), then the same with
#     both off (`FLASHRT_DEFER_LOGITS=0 FLASHRT_DEVICE_SAMPLER=0`: the row read within the
#     step, greedy argmax on the host, as before) — issue 13's "stored 16k + 1 <= 15 ms".
#
# Built here first (git-ignored .gpu/, carried packed in .gpupack/p.tar.xz):
#   cargo build --release --features cuda && strip --strip-debug target/release/flashrt -o .gpu/flashrt
#   bash scripts/gpu-check.sh --collect
#   tar -cJf .gpupack/p.tar.xz .gpu/bin .gpu/flashrt
#
#   PART=bar (~250 s, an H200): the bars' command at 16k (stored + 1 / + 32, streamed decode,
#     batched steps 1..8, 8 clients, a 16k newcomer while 4 stream), then the stored 16k + 1
#     with both off.
#
# Usage (repository root on the GPU machine): PART=tests|serve|bar bash benches/run-defer-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-defer}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
case "${PART:-tests}" in
  tests)
    OUT="$OUT/gpu-check" timeout "${SUITE_TIMEOUT:-420}" bash "$ROOT/scripts/gpu-check.sh" \
      >"$OUT/gpu-check.log" 2>&1 || status=1
    tail -14 "$OUT/gpu-check.log"
    BENCH_TIMEOUT=120 bench27 profile -- --lengths 2048 --iters 1 --decode-steps 16 --batch 1 \
      --profile
    ;;
  serve)
    "$BIN/cuda_model" --test-threads=1 host_snapshots deferred_logits >"$OUT/cuda_model.log" 2>&1 \
      || status=1
    grep -E '^test |test result' "$OUT/cuda_model.log"
    BENCH_TIMEOUT=120 bench27 batch2k -- --lengths 2048 --iters 1 --decode-steps 16 --batch 1,2,4,8
    BENCH_TIMEOUT=170 bench27 serve-defer -- --lengths 16384 --iters 1 --decode-steps 16 \
      --batch 1 --serve --serve-suffixes 1,32 --serve-runs 3
    BENCH_TIMEOUT=170 bench27 serve-eager FLASHRT_DEFER_LOGITS=0 FLASHRT_DEVICE_SAMPLER=0 -- \
      --lengths 16384 --iters 1 --decode-steps 16 --batch 1 --serve --serve-suffixes 1,32 \
      --serve-runs 3
    ;;
  bar)
    # The sampler's GPU tests and the deferred-logits ones first (seconds).
    "$BIN/cuda_sample" --test-threads=1 >"$OUT/cuda_sample.log" 2>&1 || status=1
    "$BIN/cuda_model" --test-threads=1 deferred_logits host_snapshots batched_decode \
      >"$OUT/cuda_model.log" 2>&1 || status=1
    grep -hE '^test |test result' "$OUT/cuda_sample.log" "$OUT/cuda_model.log"
    # One H200 command for the bars at 16k (as the 2026-12-06 02:13 UTC serve16k command), then
    # the stored 16k + 1 with the row read within the step and greedy on the host, as before.
    BENCH_TIMEOUT=300 bench27 bar -- --lengths 16384 --iters 1 --decode-steps 16 --batch 1,2,4,8 \
      --serve --serve-suffixes 1,32 --serve-runs 3 --serve-clients 8 --serve-newcomer 16384
    grep -E 'clients at once|newcomer' "$OUT/bar.log" | head -4
    [ "${EAGER:-1}" = 1 ] && BENCH_TIMEOUT=150 bench27 bar-eager FLASHRT_DEFER_LOGITS=0 FLASHRT_DEVICE_SAMPLER=0 -- \
      --lengths 16384 --iters 1 --decode-steps 16 --batch 1 --serve --serve-suffixes 1 \
      --serve-runs 3
    ;;
esac
exit $status
