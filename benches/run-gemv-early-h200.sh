#!/usr/bin/env bash
# One-row CUDA-core gemv launches of at most FLASHRT_GEMV_EARLY_MB MiB of weights (default 24)
# ask DRAM for their first weights before their PDL wait (kernels/gemv.cu `gemv_early_chunk`,
# `CudaOptions::gemv_early`), one device call:
#   1. cuda_ops `linear gemv fp8`, cuda_fp8 and (unless MODEL_TESTS=0) cuda_model whole (the
#      tests' models are small, so every one-row launch without a fused norm takes the early
#      path);
#   2. `flashrt bench` at one row, 2048 context, 32 decode steps — the 27B shape in bf16 and
#      with `--quantize fp8`, and the 35B-A3B shape — with `.gpu/flashrt-base` (the binary
#      before the change, when carried) and this binary with FLASHRT_GEMV_EARLY_MB = each of
#      MBS (default `0 24`: off, the default; `mb<N>` in the names), alternated, REPS rounds.
# Usage (repository root on the GPU machine, carry .gpupack/p.tar.xz):
#   [REPS=2] [MODEL_TESTS=0] [MBS="0 24 64"] bash benches/run-gemv-early-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-gemv-early}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
head -1 "$OUT/device.txt"
timeout 100 "$BIN/cuda_ops" --test-threads=1 linear gemv fp8 >"$OUT/cuda_ops.log" 2>&1 || status=1
timeout 100 "$BIN/cuda_fp8" --test-threads=1 >"$OUT/cuda_fp8.log" 2>&1 || status=1
if [ "${MODEL_TESTS:-1}" = 1 ]; then
  timeout 280 "$BIN/cuda_model" --test-threads=1 >"$OUT/cuda_model.log" 2>&1 || status=1
fi
echo "== tests"; grep -hE 'test result|panicked|FAILED' "$OUT"/cuda_*.log
variants=()
[ -x "$ROOT/.gpu/flashrt-base" ] && variants=(base)
for mb in ${MBS:-0 24}; do variants+=("mb$mb"); done
for i in $(seq 1 "${REPS:-2}"); do
  for v in "${variants[@]}"; do
    bin="$FLASHRT" envs=()
    [ "$v" = base ] && bin="$ROOT/.gpu/flashrt-base"
    [ "$v" != base ] && envs=(FLASHRT_GEMV_EARLY_MB="${v#mb}")
    for m in 27b 27b8 35b; do
      model=qwen36-27b.toml extra=()
      [ "$m" = 27b8 ] && extra=(--quantize fp8)
      [ "$m" = 35b ] && model=qwen36-35b-a3b.toml
      run_bench "$m-$v-$i" "$bin" "${envs[@]}" -- "$ROOT/models/$model" --iters 1 --lengths 2048 \
        --decode-steps 32 --batch 1 "${extra[@]}" >/dev/null
      echo "$m $v $i: $(grep -hE 'batch 1:' "$OUT/$m-$v-$i.log" | head -1 | cut -c17-); $(grep -ohE 'restored TTFT [0-9.]+ ms' "$OUT/$m-$v-$i.log" | head -1)"
    done
  done
done
exit $status
