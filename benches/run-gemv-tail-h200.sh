#!/usr/bin/env bash
# Issues 17, 16 and 13: one-row gemv launches whose last wave asks the L2 for the next launch's
# first weights (`FLASHRT_GEMV_TAIL_PF_MB`, CudaOptions::gemv_tail_prefetch, kernels/gemv.cu
# `gemv_tail_prefetch`), one device call, one binary, the sizes alternated.
#   1. GPU tests with the prefetch on (nothing computed may move): cuda_model's new test and
#      the bf16 / batched / verify / speculative ones, cuda_fp8 whole.
#   2. `flashrt bench ... --iters 1 --lengths 2048 --decode-steps 32 --batch 1` per size,
#      REPS rounds: the 27B shape in bf16 (MBS27), in FP8 (`--quantize fp8`, MBS8), the
#      35B-A3B shape (MBS35).
# Usage (repository root on the GPU machine, carry .gpupack):
#   [REPS=2] [TESTS=1] [CM_FILTER="cuda_model test names"] [MBS27="0 4 8 16"] [MBS8="0 4 8 16"]
#   [MBS35="0 8"] bash benches/run-gemv-tail-h200.sh OUT     (MBS8="": no FP8 runs or tests)
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-gemv-tail}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
head -1 "$OUT/device.txt"
if [ "${TESTS:-1}" != 0 ]; then
  # shellcheck disable=SC2086
  FLASHRT_GEMV_TAIL_PF_MB=8 timeout 240 "$BIN/cuda_model" --test-threads=1 \
    ${CM_FILTER:-gemv_tail bf16_tracks_cpu_reference batched_decode short_suffixes speculative_greedy} \
    >"$OUT/cuda_model.log" 2>&1 || status=1
  if [ -n "${MBS8-x}" ]; then
    FLASHRT_GEMV_TAIL_PF_MB=8 timeout 120 "$BIN/cuda_fp8" --test-threads=1 >"$OUT/cuda_fp8.log" 2>&1 || status=1
  fi
  echo "== tests (tail prefetch 8 MiB)"; grep -hE 'test result|panicked|FAILED|bit-identical' "$OUT"/cuda_*.log
fi
M27="$ROOT/models/qwen36-27b.toml" M35="$ROOT/models/qwen36-35b-a3b.toml"
one() { # one NAME MODEL MB [ARGS...]
  local name="$1" model="$2" mb="$3"
  shift 3
  local t0=$SECONDS
  run_bench "$name" "$FLASHRT" FLASHRT_GEMV_TAIL_PF_MB="$mb" -- "$model" --iters 1 --lengths 2048 \
    --decode-steps 32 --batch 1 "$@" >/dev/null
  echo "$name ($((SECONDS - t0)) s): $(grep -hE 'batch 1:' "$OUT/$name.log" | head -1 | cut -c17-)"
}
for i in $(seq 1 "${REPS:-2}"); do
  for mb in ${MBS27:-0 4 8 16}; do one "27b-tail$mb-$i" "$M27" "$mb"; done
  for mb in ${MBS8-0 4 8 16}; do one "27b8-tail$mb-$i" "$M27" "$mb" --quantize fp8; done
  for mb in ${MBS35-0 8}; do one "35b-tail$mb-$i" "$M35" "$mb"; done
done
exit $status
