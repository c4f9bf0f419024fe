#!/usr/bin/env bash
# The GPU half of the 2026-12-04 22:13 UTC session's work (built and checked without a device:
# benches/RESULTS.md), in two device calls of under 600 s:
#
#   PART=1  (~250 s)
#     1. benches/kernels/gemvm_micro.cu: `gemv16s_*` (mode `smem`: the CUDA-core kernel's blocks,
#        the products on the tensor cores) beside the CUDA-core and stream-K kernels, 1/2/4/8
#        rows at the 27B shapes, with "smem rows-invariant" and |smem - cores|;
#     2. the GPU tests that run gemv16s: cuda_ops `linear`, `gemv_groups_and_glu` (every
#        fusion, 1-8 rows, against the CPU) and cuda_model `batched_decode` (rows of batched
#        steps bit-identical to single steps, MTP model, gemv16s among the backends);
#     3. `flashrt bench --batch 1,2,4,8` on the 27B shape with FLASHRT_GEMV16_SMEM=0 and =1
#        (issue 15's bars: b = 2/4/8 <= 1.05/1.12/1.30x the b = 1 step).
#   PART=2  (~300 s)
#     4. the served path with the server's timings (where a client's TTFT goes inside the
#        server: parse, queue, admission = prefix lookup + restore, prefill, first token) at
#        2k and 16k, with the device memory pool keeping freed memory (FLASHRT_POOL_KEEP=1, the
#        new default) and without (=0): issue 13's "stored prefix + 1 / + 32" and exact-repeat
#        bars; and chat turns through /v1/chat/completions on a stored 2k / 16k conversation
#        (`--serve-chat tests/fixtures/text`: templating and tokenizing included).
#   PART=3  (~450 s; the 2026-12-05 session's store work)
#     5. 4 clients streaming at 16k while a 16k newcomer arrives, the device tier held to 4G so
#        the run's 1.2 GiB capsules move down the tiers: capsules demoted on threads of their
#        own (the default) against `--serve-demote-on-worker` (the clients' p99 gap, the
#        newcomer's TTFT, the worker's time per automatic capsule; issue 15's "16k prompt
#        arriving while 4 sessions stream" bar).
#
# Built here first (git-ignored .gpu/, packed as in run-pending-h200.sh):
#   cargo build --release --features cuda && strip --strip-debug target/release/flashrt -o .gpu/flashrt
#   bash scripts/gpu-check.sh --collect
#   .venv/nvcc/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels \
#       -L .venv/nvcc/cuda/lib -o .gpu/extra/gemvm_micro benches/kernels/gemvm_micro.cu
#   (and with -DGEMVS_MINB_SMALL=2 / 4 into .gpu/extra/gemvm_micro_minb2 / _minb4)
#
# Usage (repository root on the GPU machine): PART=1 bash benches/run-gemv16s-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-gemv16s}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
if [ "${PART:-1}" = 1 ]; then
  if [ -x "$ROOT/.gpu/extra/gemvm_micro" ]; then
    timeout 150 "$ROOT/.gpu/extra/gemvm_micro" >"$OUT/micro.log" 2>&1 || status=1
    grep -E '^(bf16|fp8)|R=[18] |invariant' "$OUT/micro.log"
  fi
  # The other register budgets of gemv16s at one and two rows (-DGEMVS_MINB_SMALL=2 / 4).
  for v in minb2 minb4; do
    [ -x "$ROOT/.gpu/extra/gemvm_micro_$v" ] || continue
    timeout 150 "$ROOT/.gpu/extra/gemvm_micro_$v" >"$OUT/micro-$v.log" 2>&1 || status=1
    echo "== gemv16s $v"; grep -E '^bf16|smem +R=[12] ' "$OUT/micro-$v.log"
  done
  "$BIN/cuda_ops" --test-threads=1 linear gemv_groups_and_glu >"$OUT/cuda_ops.log" 2>&1 || status=1
  "$BIN/cuda_model" --test-threads=1 batched_decode >"$OUT/cuda_model.log" 2>&1 || status=1
  grep -hE '^test |test result' "$OUT"/cuda_*.log
  for v in 0 1; do
    bench27 "batch-gemv16s-$v" FLASHRT_GEMV16_SMEM=$v -- --lengths 2048 --iters 1 \
      --decode-steps 32 --batch 1,2,4,8
  done
elif [ "${PART}" = 3 ]; then
  for v in background on-worker; do
    flag=(); [ "$v" = on-worker ] && flag=(--serve-demote-on-worker)
    bench27 "serve-store-$v" FLASHRT_POOL_KEEP=1 -- --lengths 16384 --iters 1 \
      --decode-steps 64 --batch 1 --serve --serve-suffixes 1 --serve-runs 3 \
      --serve-clients 4 --serve-newcomer 16384 --serve-budget-device 4G "${flag[@]}"
    grep -E 'clients at once|newcomer|capsule store' "$OUT/serve-store-$v.log" | head -6
  done
else
  for v in 1 0; do
    bench27 "serve-pool-keep-$v" FLASHRT_POOL_KEEP=$v -- --lengths 2048,16384 --iters 1 \
      --decode-steps 16 --batch 1 --serve --serve-suffixes 1,32 --serve-runs 3 \
      --serve-chat "$ROOT/tests/fixtures/text"
  done
fi
exit $status
