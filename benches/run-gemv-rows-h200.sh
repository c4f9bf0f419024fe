#!/usr/bin/env bash
# The GPU half of the 2026-12-06 session's work, one device call of under 600 s: the CUDA-core
# `gemv` at several rows (kernels/gemv.cu: with a fused norm, the rows normalised once per
# block into shared memory and resident blocks looping over tiles; past two rows, the next
# chunk's weights in flight while a chunk's multiply-adds run, two resident blocks per SM). Each
# row's arithmetic is unchanged, so decode, verify and batched steps keep rounding alike; what
# should move is issue 15's batched step (b = 2 / 4 / 8 at 1.28 / 2.12 / 4.90x the b = 1 step
# before) and issue 13's verify passes.
#
#   1. benches/kernels/gemvm_micro.cu (before: benches/results/2026-12-05-h200-gemv16s/
#      micro-minb2.log): the CUDA cores at R = 1, 2, 4, 8, and row 0 bit for bit at every R;
#   2. the GPU tests the kernel touches (cuda_ops `linear`, `gemv`; cuda_model batched rows
#      against single steps, verify passes against decode steps, the tile loop, speculative
#      decoding, capsules — the last also the held-rows restore of 2026-12-05);
#   3. `flashrt bench --batch 1,2,4,8` at 2k and 16k with the served path in the same command
#      (stored prefix + 1 / + 32, exact repeat, streamed decode, 8 clients, a 16k newcomer while
#      4 stream).
#
# Built here first (git-ignored .gpu/, carried packed in .gpupack/p.tar.xz):
#   cargo build --release --features cuda && strip --strip-debug target/release/flashrt -o .gpu/flashrt
#   bash scripts/gpu-check.sh --collect
#   .venv/nvcc/cuda/bin/nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I kernels \
#       -L .venv/nvcc/cuda/lib -o .gpu/extra/gemvm_micro benches/kernels/gemvm_micro.cu
#   (and with -DGEMV_XTILE=0 into .gpu/extra/gemvm_micro_xtile0)
#   tar -cJf .gpupack/p.tar.xz --exclude=.gpu/bin/cuda_fp8 --exclude=.gpu/bin/cuda_sample .gpu/bin .gpu/extra .gpu/flashrt
#
# Usage (repository root on the GPU machine): bash benches/run-gemv-rows-h200.sh OUT
# (PART=micro|tests|bench runs one part; PART=ab is a separate comparison, below.)
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-gemv-rows}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
part() { [ -z "${PART:-}" ] || [ "$PART" = "$1" ]; }
if part micro && [ -x "$ROOT/.gpu/extra/gemvm_micro" ]; then
  timeout 150 "$ROOT/.gpu/extra/gemvm_micro" >"$OUT/micro.log" 2>&1 || status=1
  grep -E '^(bf16|fp8)|cores1? +R=|invariant|differ' "$OUT/micro.log"
  # The staged kernels' blocks without the next tile's first chunk requested early.
  if [ -x "$ROOT/.gpu/extra/gemvm_micro_xtile0" ]; then
    MB_CORES=1 timeout 100 "$ROOT/.gpu/extra/gemvm_micro_xtile0" >"$OUT/micro-xtile0.log" 2>&1 || status=1
    echo "== GEMV_XTILE=0"; grep -E '^bf16|cores +R=' "$OUT/micro-xtile0.log"
  fi
fi
if part tests; then
  timeout 100 "$BIN/cuda_ops" --test-threads=1 linear gemv >"$OUT/cuda_ops.log" 2>&1 || status=1
  grep -E '^test |test result' "$OUT/cuda_ops.log"
  timeout 200 "$BIN/cuda_model" --test-threads=1 batched_decode short_suffixes gemv_tiles speculative \
    capsules_on_gpu >"$OUT/cuda_model.log" 2>&1 || status=1
  grep -E '^test |test result' "$OUT/cuda_model.log"
fi
if part bench; then
  BENCH_TIMEOUT="${BENCH_TIMEOUT:-280}" bench27 batch-serve -- --lengths 2048,16384 --iters 1 \
    --decode-steps 16 --batch 1,2,4,8 --serve --serve-suffixes 1,32 --serve-runs 3 \
    --serve-clients 8 --serve-newcomer 16384
  grep -E 'clients at once|newcomer|verify' "$OUT/batch-serve.log" | head -8
fi
# PART=ab: the same device before and after. The microbenchmark built from the kernels as they
# were (commit 1e3993c: .gpu/extra/gemvm_micro_old), the 27B step with the staged rows off
# (FLASHRT_GEMV_STAGE=0: the pipelined loop and two blocks per SM stay) and on, and the served
# path at 16k with and without the held rows (the 2026-12-05 work; MINI of run-restore-h200.sh;
# RESTORE=0 leaves it out).
if [ "${PART:-}" = ab ]; then
  timeout 100 "$BIN/cuda_model" --test-threads=1 batched_decode >"$OUT/cuda_model-batched.log" 2>&1 || status=1
  grep -E '^test |test result' "$OUT/cuda_model-batched.log"
  if [ -x "$ROOT/.gpu/extra/gemvm_micro_old" ]; then
    timeout 150 "$ROOT/.gpu/extra/gemvm_micro_old" >"$OUT/micro-old.log" 2>&1 || status=1
    echo "== before (1e3993c)"; grep -E '^bf16|cores +R=' "$OUT/micro-old.log"
  fi
  if [ -x "$ROOT/.gpu/extra/gemvm_micro" ]; then
    MB_CORES=1 timeout 100 "$ROOT/.gpu/extra/gemvm_micro" >"$OUT/micro-new.log" 2>&1 || status=1
    echo "== after"; grep -E '^bf16|cores +R=|invariant' "$OUT/micro-new.log"
  fi
  for st in 0 1; do
    BENCH_TIMEOUT=150 bench27 batch-stage$st FLASHRT_GEMV_STAGE=$st -- --lengths 2048 --iters 1 \
      --decode-steps 16 --batch 1,2,4,8 $([ $st = 1 ] && echo --profile)
  done
  # Where the 8-row step's time goes, beside the one-row step's (`--profile`).
  grep -E '^profile|^  ' "$OUT/batch-stage1.log" | grep -A14 -E '^profile: (decode at|decode\[8\])' | head -34
  if [ "${RESTORE:-1}" = 1 ]; then
    OUT="$OUT/restore" MINI=1 BENCH_TIMEOUT=120 bash "$ROOT/benches/run-restore-h200.sh" "$OUT/restore"
  fi
fi
exit $status
