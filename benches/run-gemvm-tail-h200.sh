#!/usr/bin/env bash
# The tensor-core gemv's split tiles finished from shares published mid-stream
# (`GEMVM_EARLY_SHARES=1` in kernels/gemv_mma.cu) against the default (shares published at the
# end of each warp's stream, the last to arrive finishing), on the GPU machine in ONE command:
#
#   1. benches/kernels/gemvm_micro.cu three ways: the default kernel (.gpu/extra/gemvm_base),
#      the variant (gemvm_new), and the default without finishing split tiles (gemvm_bound,
#      -DGEMVM_NO_FIXUP: a timing bound, wrong outputs);
#   2. the Qwen3.6-27B shape's decode with the tensor-core gemv (bf16, FLASHRT_GEMV16_MMA=1,
#      batched steps 1/2/4/8) and in FP8 (gemv8m: decode, restored TTFT), the default and the
#      variant (FLASHRT_KERNELS_DIR=.gpu/kv/early) alternated, twice; and the variant with
#      FP8's many-split matrices (down / out, 6.6 warps a tile) on the tensor cores too
#      (FLASHRT_GEMV8M_MAX_SPLITS=0);
#   3. the GPU tests the kernel touches, with the variant loaded (cuda_ops linear / gemv / fp8,
#      cuda_fp8, cuda_model with FLASHRT_GEMV16_MMA=1).
#
# Built here first (git-ignored .gpu/, carried packed in .gpupack/):
#   cargo build --release --features cuda && strip --strip-debug target/release/flashrt -o .gpu/flashrt
#   bash scripts/gpu-check.sh --collect
#   bash scripts/build-kernel-variant.sh early gemv -DGEMVM_EARLY_SHARES=1
#   NV="nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -L .venv/nvcc/cuda/lib -I kernels"
#   $NV -o .gpu/extra/gemvm_base benches/kernels/gemvm_micro.cu
#   $NV -DGEMVM_EARLY_SHARES=1 -o .gpu/extra/gemvm_new benches/kernels/gemvm_micro.cu
#   $NV -DGEMVM_NO_FIXUP -o .gpu/extra/gemvm_bound benches/kernels/gemvm_micro.cu
#   tar -cJf .gpupack/p.tar.xz .gpu/flashrt .gpu/bin/cuda_ops .gpu/extra
#   tar -cJf .gpupack/t.tar.xz .gpu/bin/cuda_model .gpu/bin/cuda_fp8
#   tar -cf .gpupack/kv.tar .gpu/kv/early
# A call carries at most 64 MiB with the tree (~22 MB): carry .gpupack/p.tar.xz and
# .gpupack/kv.tar for the micro and bench parts (and cuda_ops), .gpupack/t.tar.xz and
# .gpupack/kv.tar for the rest of the tests.
#
# Usage (repository root on the GPU machine): bash benches/run-gemvm-tail-h200.sh OUT
# (about nine device minutes in all: more than one call allows, so split it, e.g. PART=micro
# and PART=bench RUNS=1 in one call, PART=tests in the next; see the packs above)
# PART=micro|bench|tests runs one part; RUNS="1" one round of the A/B benches (default "1 2");
# MICRO="base new" the microbenchmark builds to run (default "base new bound"); SPLITS0=0 skips
# the FLASHRT_GEMV8M_MAX_SPLITS=0 bench.
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-gemvm-tail}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/benches/h200-common.sh"
KV="$ROOT/.gpu/kv/early"
part() { [ -z "${PART:-}" ] || [ "$PART" = "$1" ]; }
if part micro; then
  for v in ${MICRO:-base new bound}; do
    timeout 120 "$ROOT/.gpu/extra/gemvm_$v" >"$OUT/micro-$v.log" 2>&1 || status=1
    echo "== micro $v"
    grep -E '^(bf16|fp8)|mma +R=|cores +R=|invariant|differ' "$OUT/micro-$v.log" | head -60
  done
fi
if part bench; then
  M="$ROOT/models/qwen36-27b.toml"
  for run in ${RUNS:-1 2}; do
    for b in base early; do
      kv=()
      [ "$b" = early ] && kv=(FLASHRT_KERNELS_DIR="$KV")
      run_bench "fp8-$b-$run" "$FLASHRT" "${kv[@]}" -- "$M" --quantize fp8 --lengths 2048 --iters 1 \
        --decode-steps 24 --batch 1,8
      grep -E 'per step|restored TTFT [0-9]|^ +2048 +[18] ' "$OUT/fp8-$b-$run.log" | head -6
      run_bench "mma-$b-$run" "$FLASHRT" "${kv[@]}" FLASHRT_GEMV16_MMA=1 -- "$M" --lengths 2048 --iters 1 \
        --decode-steps 24 --batch 1,2,4,8
      grep -E 'per step|^ +2048 +[1248] ' "$OUT/mma-$b-$run.log" | head -6
    done
    [ "${SPLITS0:-1}" = 0 ] && continue
    run_bench "fp8-early-splits0-$run" "$FLASHRT" FLASHRT_KERNELS_DIR="$KV" FLASHRT_GEMV8M_MAX_SPLITS=0 -- "$M" \
      --quantize fp8 --lengths 2048 --iters 1 --decode-steps 24 --batch 1,8
    grep -E 'per step|restored TTFT [0-9]|^ +2048 +[18] ' "$OUT/fp8-early-splits0-$run.log" | head -6
  done
fi
if part tests; then
  # (Each test binary that was carried, the variant loaded.)
  [ -f "$ROOT/.gpupack/t.tar.xz" ] && [ ! -x "$BIN/cuda_model" ] && tar -xJf "$ROOT/.gpupack/t.tar.xz" -C "$ROOT"
  export FLASHRT_KERNELS_DIR="$KV"
  {
    [ -x "$BIN/cuda_ops" ] && timeout 150 "$BIN/cuda_ops" --test-threads=1 linear gemv fp8 2>&1
    [ -x "$BIN/cuda_fp8" ] && timeout 120 "$BIN/cuda_fp8" --test-threads=1 2>&1
    [ -x "$BIN/cuda_model" ] && FLASHRT_GEMV16_MMA=1 timeout 240 "$BIN/cuda_model" --test-threads=1 2>&1
  } >>"$OUT/tests.log" || status=1
  grep -hE '^test |test result|panicked' "$OUT/tests.log" | grep -v ' ok$'
fi
exit $status
