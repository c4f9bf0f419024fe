#!/usr/bin/env bash
# Issue 16: the 35B-A3B decode step with the next layer's first matmul asked of the L2 by the
# MoE block's routed up launch (`FLASHRT_MOE_PREFETCH_MB`, CudaOptions::moe_prefetch) and the
# experts' weights streamed evict-first (`MOE_EVICT_FIRST`, kernels/common.cuh), each alone and
# together, against the same binary with both off (the moe family built with
# -DMOE_EVICT_FIRST=0: `bash scripts/build-kernel-variant.sh noef moe -DMOE_EVICT_FIRST=0`).
# One device call, one binary, the configurations alternated.
#   1. GPU tests: cuda_model's MoE tests with the prefetch on (what is computed must not move).
#   2. `flashrt bench models/qwen36-35b-a3b.toml --iters 1 --lengths 2048 --decode-steps 64
#      --batch 1` per configuration, REPS times; EXTRA="name:VAR=v,VAR=v ..." adds
#      configurations (a kernel variant as FLASHRT_KERNELS_DIR=.gpu/kv/<name>).
# Usage (repository root on the GPU machine, carry .gpupack):
#   [REPS=2] [TESTS=0] [MBS="16 32"] bash benches/run-moe-prefetch-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-moe-prefetch}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
NOEF="FLASHRT_KERNELS_DIR=$ROOT/.gpu/kv/noef"
if [ "${TESTS:-1}" != 0 ]; then
  FLASHRT_MOE_PREFETCH_MB=16 "$BIN/cuda_model" --test-threads=1 moe_ bf16_tracks_cpu_reference \
    >"$OUT/cuda_model-moe.log" 2>&1 || status=1
  echo "== tests"; grep -hE 'test result|panicked|FAILED' "$OUT/cuda_model-moe.log"
fi
configs=("off:$NOEF,FLASHRT_MOE_PREFETCH_MB=0" "ef:FLASHRT_MOE_PREFETCH_MB=0")
for mb in ${MBS:-16 32}; do
  configs+=("ef-pf$mb:FLASHRT_MOE_PREFETCH_MB=$mb" "pf$mb:$NOEF,FLASHRT_MOE_PREFETCH_MB=$mb")
done
# shellcheck disable=SC2206
configs+=(${EXTRA:-})
M35="$ROOT/models/qwen36-35b-a3b.toml"
for i in $(seq 1 "${REPS:-2}"); do
  for c in "${configs[@]}"; do
    name="${c%%:*}" envs=()
    IFS=, read -r -a envs <<<"${c#*:}"
    t0=$SECONDS
    run_bench "35b-$name-$i" "$FLASHRT" "${envs[@]}" -- "$M35" --iters 1 --lengths 2048 --decode-steps 64 --batch 1 >/dev/null
    echo "$name $i ($((SECONDS - t0)) s): $(grep -hE 'batch 1:' "$OUT/35b-$name-$i.log" | head -1)"
  done
done
exit $status
