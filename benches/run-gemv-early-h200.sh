#!/usr/bin/env bash
# One-row gemv launches that ask DRAM for their first weights before their PDL wait
# (kernels/gemv.cu `GEMV_EARLY`; the variant `.gpu/kv/early/gemv.fatbin` =
# `bash scripts/build-kernel-variant.sh early gemv -DGEMV_EARLY=1`; `early2`, with
# -DGEMV_EARLY=2, also the launches with the fused norm, whose 8-feature kernels then spill),
# one short device call:
#   1. cuda_ops `linear gemv fp8` with each variant loaded (against the CPU reference, and
#      batched / several-row launches against one-row ones: the same bits);
#   2. `flashrt bench` at one row, 2048 context, 32 decode steps — the 27B shape in bf16 and
#      with `--quantize fp8`, and the 35B-A3B shape — the committed kernels (`base`) and each of
#      VARIANTS (default `early early2`, those present under .gpu/kv) alternated, REPS rounds.
# Usage (repository root on the GPU machine, carry .gpupack with the binaries and kv.tar):
#   [REPS=2] bash benches/run-gemv-early-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-gemv-early}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
VARIANTS=(${VARIANTS:-early early2})
head -1 "$OUT/device.txt"
for v in "${VARIANTS[@]}"; do
  FLASHRT_KERNELS_DIR="$ROOT/.gpu/kv/$v" timeout 200 "$BIN/cuda_ops" --test-threads=1 linear gemv fp8 \
    >"$OUT/cuda_ops-$v.log" 2>&1 || status=1
  echo "== cuda_ops linear gemv fp8 with $v"; grep -hE 'test result|panicked|FAILED' "$OUT/cuda_ops-$v.log"
done
for i in $(seq 1 "${REPS:-2}"); do
  for v in base "${VARIANTS[@]}"; do
    envs=()
    [ "$v" != base ] && envs=(FLASHRT_KERNELS_DIR="$ROOT/.gpu/kv/$v")
    for m in 27b 27b8 35b; do
      model=qwen36-27b.toml extra=()
      [ "$m" = 27b8 ] && extra=(--quantize fp8)
      [ "$m" = 35b ] && model=qwen36-35b-a3b.toml
      run_bench "$m-$v-$i" "$FLASHRT" "${envs[@]}" -- "$ROOT/models/$model" --iters 1 --lengths 2048 \
        --decode-steps 32 --batch 1 "${extra[@]}" >/dev/null
      echo "$m $v $i: $(grep -hE 'batch 1:' "$OUT/$m-$v-$i.log" | head -1 | cut -c17-); $(grep -ohE 'restored TTFT [0-9.]+ ms' "$OUT/$m-$v-$i.log" | head -1)"
    done
  done
done
exit $status
