#!/usr/bin/env bash
# The 2026-12-06 05:56 UTC session's GPU check, one device call (~250 s on an H200):
#
#   1. The bars' command at 16k (stored + 1 / + 32, streamed decode, batched steps 1..8, 8 clients,
#   a 16k newcomer while 4 stream) with the store's slack (`StoreConfig::slack_device`: a capsule
#   stored while the previous one is still being copied to the host does not wait for it), the
#   demotion jobs' phases logged (`flashrt_runtime::store=debug`: read-back, hashing, delta).
#   The previous H200 run (2026-12-06 04:46 UTC, without slack) had the newcomer's clients' gaps
#   after its first token at p99 776 ms, 702 ms of it the wait for the previous demotion.
#   Host copies leaving memory give their buffers to the next demotions (host_pool.rs): the
#   GPU test `store_demotions_into_reused_host_buffers_restore_exactly_on_gpu` first.
#   2. The device tier held to 4G: 4 clients streaming and the newcomer, every stored capsule
#   moving down, the worker's time per automatic capsule (2026-12-05: 105-142 ms, waiting).
#
# Built here first (git-ignored .gpu/, carried packed in .gpupack/p.tar.xz):
#   cargo build --release --features cuda && strip --strip-debug target/release/flashrt -o .gpu/flashrt
#   bash scripts/gpu-check.sh --collect
#   tar -cJf .gpupack/p.tar.xz .gpu/bin/cuda_model .gpu/bin/cuda_sample .gpu/flashrt
#
#   3. (PART=ab) reused host buffers and parallel host copies, see below.
#
# Usage (repository root on the GPU machine): [PART=ab] bash benches/run-slack-h200.sh OUT
# (CLIENTS=4 on an 80 GB card: 8 sessions at 16k and a device tier do not fit beside the weights)
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-slack}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
if [ "${PART:-bar}" = ab ]; then
  # 3. Reused host buffers and parallel host copies (host_pool.rs, read_staged's copy on 4
  # threads): the device tier held to 4G and the host tier to 3G (capsules leave host memory,
  # their buffers go to the pool), 4 clients and the newcomer; the same with the huge-page
  # advice off for fresh buffers (FLASHRT_HOST_HUGEPAGES=0).
  "$BIN/cuda_model" --test-threads=1 store_demotions >"$OUT/cuda_model.log" 2>&1 || status=1
  grep -hE '^test |test result' "$OUT/cuda_model.log"
  for v in pool pool-nohuge; do
    e=RUST_LOG=info,flashrt_runtime::store=debug
    [ $v = pool-nohuge ] && e="$e FLASHRT_HOST_HUGEPAGES=0"
    # shellcheck disable=SC2086
    BENCH_TIMEOUT=200 bench27 $v $e -- --lengths 16384 --iters 1 --decode-steps 64 --batch 1 \
      --serve --serve-suffixes 1,32 --serve-runs 3 --serve-clients 4 --serve-newcomer 16384 \
      --serve-budget-device 4G --serve-budget-host 3G
    grep -E 'a 16384-token prompt|capsule store:' "$OUT/$v.log" | head -3
    grep -E 'demotion job' "$OUT/$v.log" | sed 's/.*demotion job: //' >"$OUT/demotions-$v.txt"
    cut -c1-60 "$OUT/demotions-$v.txt" | tr '\n' ';' | head -c 900; echo
  done
  exit $status
fi
"$BIN/cuda_model" --test-threads=1 deferred_logits host_snapshots batched_decode store_demotions \
  >"$OUT/cuda_model.log" 2>&1 || status=1
grep -hE '^test |test result' "$OUT/cuda_model.log"
bar16k
grep -E 'demotion job' "$OUT/bar.log" | sed 's/.*demotion job: //' | head -40 >"$OUT/demotions.txt"
head -5 "$OUT/demotions.txt"
[ "${STORE4G:-1}" = 1 ] || exit $status
# The device tier held to 4G (capsules of 1.2 GiB move down at every store), 4 clients and the
# newcomer, as the 2026-12-05 store runs: the worker's time per automatic capsule.
BENCH_TIMEOUT=200 bench27 store4g RUST_LOG=info,flashrt_runtime::store=debug -- --lengths 16384 \
  --iters 1 --decode-steps 64 --batch 1 --serve --serve-suffixes 1 --serve-runs 3 \
  --serve-clients 4 --serve-newcomer 16384 --serve-budget-device 4G
grep -E 'clients at once|a 16384-token prompt|capsule store:|device memory' "$OUT/store4g.log" | head -6
grep -E 'demotion job' "$OUT/store4g.log" | sed 's/.*demotion job: //' >"$OUT/demotions-4g.txt"
head -5 "$OUT/demotions-4g.txt"
exit $status
