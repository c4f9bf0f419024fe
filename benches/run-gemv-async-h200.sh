#!/usr/bin/env bash
# Several-row gemv launches with each thread's weight chunks streamed through a ring of two
# slots in shared memory (kernels/gemv.cu `gemv_async_tiles`). One device call, one binary;
# variants are the gemv family's fatbin built with other flags and loaded through
# FLASHRT_KERNELS_DIR (`bash scripts/build-kernel-variant.sh NAME gemv FLAGS`).
#   First run (2026-12-06 19:10, H100; the binary's default then had no ring): the variant
#   `-DGEMV_ASYNC=1` of that build, every launch past two rows through the ring.
#   Second run (VARIANTS="off all"): the binary's default = the ring for fused-norm launches
#   only (`GEMV_ASYNC` 1), `off` = `-DGEMV_ASYNC=0` (no ring), `all` = `-DGEMV_ASYNC=2` (every
#   launch past two rows).
#   1. GPU tests of the default (and of each variant in TEST_VARIANTS: batched rows bit-identical to single
#      steps, every gemv option's verify passes bit-identical, short suffixes as verify
#      passes, bf16 against the CPU reference, speculative decoding; cuda_ops' gemv tests).
#   2. `flashrt bench --batch 1,2,4,8` at 2048 on models/qwen36-27b.toml, default and variants
#      alternated, then the default's 8-row step profiled.
# Usage (repository root on the GPU machine, carry .gpupack): [REPS=2] [VARIANTS="off all"] [TEST_VARIANTS=...] bash benches/run-gemv-async-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-gemv-async}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
VARIANTS="${VARIANTS:-off all}"
for v in default ${TEST_VARIANTS:-}; do
  kd=""; [ "$v" = default ] || kd="$ROOT/.gpu/kv/$v"
  tests="batched_decode gemv_tiles_compute short_suffixes bf16_tracks_cpu_reference speculative_greedy"
  [ "$v" = default ] && tests="$tests fixtures_f32 capsules_on_gpu unaligned_restore"
  # shellcheck disable=SC2086
  FLASHRT_KERNELS_DIR="$kd" "$BIN/cuda_model" --test-threads=1 $tests >"$OUT/cuda_model-$v.log" 2>&1 || status=1
  FLASHRT_KERNELS_DIR="$kd" "$BIN/cuda_ops" --test-threads=1 linear gemv_groups_and_glu >"$OUT/cuda_ops-$v.log" 2>&1 || status=1
  echo "== tests $v"; grep -hE 'test result|panicked|FAILED' "$OUT/cuda_model-$v.log" "$OUT/cuda_ops-$v.log"
done
M27="$ROOT/models/qwen36-27b.toml"
b() {
  local name="$1"; shift
  run_bench "$name" "$FLASHRT" "$@" -- "$M27" --iters 1 --lengths 2048 --decode-steps 32 --batch 1,2,4,8
  grep -E '^ +2048 +[1248] ' "$OUT/$name.log" | head -4
}
for i in $(seq "${REPS:-2}"); do
  b default-$i
  for v in $VARIANTS; do b "$v-$i" FLASHRT_KERNELS_DIR="$ROOT/.gpu/kv/$v"; done
done
run_bench default-profile8 "$FLASHRT" -- "$M27" --iters 1 --lengths 2048 --decode-steps 16 --batch 1,8 --profile
awk '/^profile: decode\[8\]/{p=1} /^profile: prefill/{p=0} p' "$OUT/default-profile8.log" | head -14
exit $status
