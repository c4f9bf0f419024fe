#!/usr/bin/env bash
# The tensor-core gemv with split tiles finished from shares published mid-stream (the default
# since 2026-12-07, kernels/gemv_mma.cu) against the binary before it, on the GPU machine:
#
#   bench: the Qwen3.6-27B shape's decode at 2048, the binary before (.gpu/flashrt-old) and
#          after (.gpu/flashrt) alternated RUNS times: FP8 (gemv8m; decode, restored TTFT,
#          --batch 1,8), bf16 with the default CUDA-core gemv and with the tensor-core gemv
#          (FLASHRT_GEMV16_MMA=1), --batch 1,2,4,8;
#   tests: every GPU test binary that was carried (.gpu/bin), the new kernel built in;
#   probe: benches/kernels/gemvm_micro.cu with per-warp phase stamps (-DFLASHRT_PROBE): the
#          kernel, the isolating builds below (where built) and its no-fix-up bound — where the
#          2-7 us a launch still loses to finishing split tiles go (stream end vs the end of the
#          finish, median / last warp).
#
# Built here first (git-ignored .gpu/, carried packed in .gpupack/):
#   cp <the previous build's stripped flashrt> .gpu/flashrt-old
#   cargo build --release --features cuda && strip --strip-debug target/release/flashrt -o .gpu/flashrt
#   bash scripts/gpu-check.sh --collect
#   NV="nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -L .venv/nvcc/cuda/lib -I kernels"
#   $NV -DFLASHRT_PROBE -o .gpu/extra/gemvm_probe benches/kernels/gemvm_micro.cu
#   $NV -DFLASHRT_PROBE -DGEMVM_NO_FIXUP -o .gpu/extra/gemvm_probe_bound benches/kernels/gemvm_micro.cu
# and, to split what finishing split tiles costs (benches/kernels/gemv_mma_finish_isolate.patch:
# wrong outputs, timing only): the finisher reading the shares once without waiting for their
# tags (nowait), and no shares published at all (nopub; nothing waited for either):
#   git apply benches/kernels/gemv_mma_finish_isolate.patch
#   $NV -DFLASHRT_PROBE -DGEMVM_PROBE_NO_WAIT -o .gpu/extra/gemvm_probe_nowait benches/kernels/gemvm_micro.cu
#   $NV -DFLASHRT_PROBE -DGEMVM_PROBE_NO_PUBLISH -o .gpu/extra/gemvm_probe_nopub benches/kernels/gemvm_micro.cu
#   git apply -R benches/kernels/gemv_mma_finish_isolate.patch
# and the shares of split tiles finished in the same block through shared memory
# (benches/kernels/gemv_mma_smem_shares.patch; same bits by construction, the micro's `bits`):
#   git apply benches/kernels/gemv_mma_smem_shares.patch
#   $NV -DFLASHRT_PROBE -DGEMVM_SMEM_SHARES=1 -o .gpu/extra/gemvm_probe_sshare benches/kernels/gemvm_micro.cu
#   bash scripts/build-kernel-variant.sh sshare gemv -DGEMVM_SMEM_SHARES=1
#   git apply -R benches/kernels/gemv_mma_smem_shares.patch
#   tar -cf - .gpu/flashrt .gpu/flashrt-old .gpu/bin .gpu/extra | xz --lzma2=preset=6,dict=192MiB >.gpupack/p.tar.xz
# (The binaries share their embedded kernels: with a dictionary spanning them all the pack is
# ~20 MB instead of ~60, so one call — at most 64 MiB with the ~22 MB tree — carries it all.)
#
# Usage (repository root on the GPU machine): PART=bench|tests|probe bash benches/run-gemvm-tail-h200.sh OUT
# (no PART: all three, tests first); RUNS="1" one round of the A/B (default "1 2"); MMA=0 / CORES=0 skip the bf16
# tensor-core / CUDA-core benches; TESTS="cuda_ops ..." the test binaries to run (default all
# four), MODEL_MMA=0 skips cuda_model's second run with the tensor-core gemv; cuda_ops_filter="linear gemv"
# (and likewise for each binary) runs only the tests whose names hold one of the words;
# VARIANTS="sshare" also runs the (filtered) tests and the benches with each gemv family variant
# in .gpu/kv (scripts/build-kernel-variant.sh NAME gemv [FLAGS]; carried as .gpupack/kv.tar);
# FP8_ALL_MMA=1 adds the FP8 bench with every matrix on the tensor cores
# (FLASHRT_GEMV8M_MAX_SPLITS=0) for each binary but the old one.
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-gemvm-tail}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/benches/h200-common.sh"
part() { [ -z "${PART:-}" ] || [ "$PART" = "$1" ]; }
if part tests; then
  for t in ${TESTS:-cuda_ops cuda_fp8 cuda_sample cuda_model}; do
    [ -x "$BIN/$t" ] || continue
    f="${t}_filter"
    # shellcheck disable=SC2086 # the filters are words
    timeout 240 "$BIN/$t" --test-threads=1 ${!f:-} >"$OUT/tests-$t.log" 2>&1 || status=1
    echo "== $t: $(grep -c '^test .* ok$' "$OUT/tests-$t.log") ok"
    grep -hE '^test |test result|panicked' "$OUT/tests-$t.log" | grep -v ' ok$'
  done
  # Kernel-family variants (.gpu/kv/NAME, carried as .gpupack/kv.tar): the same tests with
  # the variant loaded, the tensor-core gemv on.
  for v in ${VARIANTS:-}; do
    for t in cuda_ops cuda_model; do
      [ -x "$BIN/$t" ] || continue
      f="${t}_filter"
      # shellcheck disable=SC2086
      FLASHRT_KERNELS_DIR="$ROOT/.gpu/kv/$v" FLASHRT_GEMV16_MMA=1 timeout 240 "$BIN/$t" --test-threads=1 ${!f:-} \
        >"$OUT/tests-$t-$v.log" 2>&1 || status=1
      echo "== $t ($v): $(grep -c '^test .* ok$' "$OUT/tests-$t-$v.log") ok"
      grep -hE '^test |test result|panicked' "$OUT/tests-$t-$v.log" | grep -v ' ok$'
    done
  done
  # The tensor-core gemv in every small phase of the model tests.
  if [ -x "$BIN/cuda_model" ] && [ "${MODEL_MMA:-1}" != 0 ]; then
    # shellcheck disable=SC2086
    FLASHRT_GEMV16_MMA=1 timeout 240 "$BIN/cuda_model" --test-threads=1 ${cuda_model_filter:-} \
      >"$OUT/tests-cuda_model-mma.log" 2>&1 || status=1
    echo "== cuda_model (FLASHRT_GEMV16_MMA=1): $(grep -c '^test .* ok$' "$OUT/tests-cuda_model-mma.log") ok"
    grep -hE '^test |test result|panicked' "$OUT/tests-cuda_model-mma.log" | grep -v ' ok$'
  fi
fi
if part bench; then
  M="$ROOT/models/qwen36-27b.toml"
  for run in ${RUNS:-1 2}; do
    for b in old new ${VARIANTS:-}; do
      bin="$FLASHRT"
      kv=()
      [ "$b" = old ] && bin="$ROOT/.gpu/flashrt-old"
      [ "$b" != old ] && [ "$b" != new ] && kv=("FLASHRT_KERNELS_DIR=$ROOT/.gpu/kv/$b")
      run_bench "fp8-$b-$run" "$bin" "${kv[@]}" -- "$M" --quantize fp8 --lengths 2048 --iters 1 --decode-steps 24 \
        --batch 1,8
      grep -E 'restored TTFT [0-9]|^ +2048 +[18] ' "$OUT/fp8-$b-$run.log" | head -6
      if [ "${FP8_ALL_MMA:-0}" = 1 ] && [ "$b" != old ]; then
        # Every FP8 matrix on the tensor cores (down / out included): one kernel kind for all.
        run_bench "fp8all-$b-$run" "$bin" "${kv[@]}" FLASHRT_GEMV8M_MAX_SPLITS=0 -- "$M" --quantize fp8 --lengths 2048 \
          --iters 1 --decode-steps 24 --batch 1,8
        grep -E 'restored TTFT [0-9]|^ +2048 +[18] ' "$OUT/fp8all-$b-$run.log" | head -6
      fi
      if [ "${CORES:-1}" != 0 ]; then
        run_bench "bf16-$b-$run" "$bin" "${kv[@]}" -- "$M" --lengths 2048 --iters 1 --decode-steps 24 --batch 1,2,4,8
        grep -E '^ +2048 +[1248] ' "$OUT/bf16-$b-$run.log" | head -4
      fi
      if [ "${MMA:-1}" != 0 ]; then
        run_bench "mma-$b-$run" "$bin" "${kv[@]}" FLASHRT_GEMV16_MMA=1 -- "$M" --lengths 2048 --iters 1 --decode-steps 24 \
          --batch 1,2,4,8
        grep -E '^ +2048 +[1248] ' "$OUT/mma-$b-$run.log" | head -4
      fi
    done
  done
fi
if part probe; then
  for v in probe probe_sshare probe_nowait probe_nopub probe_bound; do
    [ -x "$ROOT/.gpu/extra/gemvm_$v" ] || continue
    timeout 60 "$ROOT/.gpu/extra/gemvm_$v" >"$OUT/micro-$v.log" 2>&1 || status=1
    echo "== $v"
    grep -E '^(bf16|fp8)|mma +R=1 ' -A1 "$OUT/micro-$v.log" | grep -E '^(bf16|fp8)|mma +R=1 |probe' | head -24
  done
fi
exit $status
