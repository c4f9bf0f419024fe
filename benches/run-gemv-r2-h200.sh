#!/usr/bin/env bash
# Two-row gemv launches (issue 15's b = 2 bar: a 2-row step <= 1.05x one row; H100 18:01 run:
# 1.08x, the gemvs +1.23 ms of the +1.57): which shape of the fused-norm 2-row launch streams
# best, one device call, one binary:
#   - staged (default): resident blocks, rows normalised once into shared memory, 2 an SM;
#   - `FLASHRT_GEMV_STAGE=3`: two rows not staged (one block a tile, per-tile norm, as at one row);
#   - fatbins of the gemv family built with other flags and loaded through FLASHRT_KERNELS_DIR
#     (.gpu/kv/<name>/gemv.fatbin, `bash .gpu/kv/build.sh NAME FLAGS`): `minb3`
#     (-DGEMV_MINB_R2=3: 80 registers, 3 blocks an SM), `pipe2` (-DGEMV_PIPE_MIN_ROWS=2: the
#     next chunk's weights requested before this chunk's multiply-adds, as past two rows).
# First the GPU tests under each fatbin (same bits as the CPU reference and as single steps).
# Usage (repository root on the GPU machine, carry .gpupack): [REPS=2] bash benches/run-gemv-r2-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-gemv-r2}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
[ -d "$ROOT/.gpu/kv" ] || tar -xJf "$ROOT/.gpupack/kv.tar.xz" -C "$ROOT"
KV="$ROOT/.gpu/kv"
for v in "" $(ls "$KV" | grep -v build.sh); do
  FLASHRT_KERNELS_DIR="${v:+$KV/$v}" "$BIN/cuda_model" --test-threads=1 gemv_tiles_compute batched_decode \
    short_suffixes bf16_tracks_cpu_reference >"$OUT/cuda_model-${v:-base}.log" 2>&1 || status=1
  echo "== tests ${v:-base}"; grep -hE 'test result|panicked|FAILED' "$OUT/cuda_model-${v:-base}.log"
done
M27="$ROOT/models/qwen36-27b.toml"
b() {
  local name="$1"; shift
  run_bench "$name" "$FLASHRT" "$@" -- "$M27" --iters 1 --lengths 2048 --decode-steps 32 --batch 1,2,4
  grep -E '^ +2048 +[124] ' "$OUT/$name.log" | head -3
}
for i in $(seq "${REPS:-2}"); do
  b base-$i
  b stage3-$i FLASHRT_GEMV_STAGE=3
  for v in $(ls "$KV" | grep -v build.sh); do
    b "$v-$i" FLASHRT_KERNELS_DIR="$KV/$v"
    b "$v-stage3-$i" FLASHRT_KERNELS_DIR="$KV/$v" FLASHRT_GEMV_STAGE=3
  done
done
exit $status
