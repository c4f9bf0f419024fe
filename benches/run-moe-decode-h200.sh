#!/usr/bin/env bash
# The 35B-A3B shape's decode step with the MoE small-phase launches varied: the shared expert's
# L2 prefetch before the PDL waits (CudaOptions::moe_prefetch, `FLASHRT_MOE_PREFETCH`), the
# up launch's resident blocks an SM (kernels/moe_small.cu `-DMOE_UP_MINB=N`) and the moe family
# as committed before a change (`old`), the variants built with scripts/build-kernel-variant.sh
# into .gpu/kv/<name> and carried as .gpupack/kv.tar. One device call, one binary, the
# variants alternated.
#   1. GPU tests: the MoE tests (`moe_prefetch_changes_no_bit`, routing, wide prefill), the
#      fixtures against transformers (f32) and bf16 against the CPU reference.
#   2. `flashrt bench` on models/qwen36-35b-a3b.toml at 2048, one row, each variant REPS times;
#      BATCH=1 adds `--batch 1,2,4,8` for the committed defaults (141 GB cards).
# Usage (repository root on the GPU machine, carry .gpupack):
#   [REPS=2] [BATCH=0] bash benches/run-moe-decode-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-moe-decode}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
"$BIN/cuda_model" --test-threads=1 moe_ fixtures_f32_match_transformers bf16_tracks_cpu_reference \
  >"$OUT/cuda_model-moe.log" 2>&1 || status=1
echo "== tests"; grep -hE 'test result|panicked|FAILED|bit-identical' "$OUT/cuda_model-moe.log"
M35="$ROOT/models/qwen36-35b-a3b.toml"
# name, then the variables it runs with.
VARIANTS=(
  "old FLASHRT_KERNELS_DIR=$ROOT/.gpu/kv/base"
  "new FLASHRT_MOE_PREFETCH=1"
  "off FLASHRT_MOE_PREFETCH=0"
  "up3 FLASHRT_KERNELS_DIR=$ROOT/.gpu/kv/up3"
)
for i in $(seq "${REPS:-2}"); do
  for v in "${VARIANTS[@]}"; do
    read -r name envs <<<"$v"
    # shellcheck disable=SC2086
    run_bench "35b-$name-$i" "$FLASHRT" $envs -- "$M35" --iters 1 --lengths 2048 --decode-steps 64 --batch 1
    grep -hE 'batch 1:' "$OUT/35b-$name-$i.log" | head -1
  done
done
if [ "${BATCH:-0}" = 1 ]; then
  run_bench 35b-batch "$FLASHRT" -- "$M35" --iters 1 --lengths 2048 --decode-steps 32 --batch 1,2,4,8
  grep -E '^ +2048 +[1248] ' "$OUT/35b-batch.log" | head -4
fi
exit $status
