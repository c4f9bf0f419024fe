#!/usr/bin/env bash
# Two-row gemv launches (issue 15's b = 2 bar: a 2-row step <= 1.05x one row; H100 18:01 run:
# 1.08x, the gemvs +1.23 ms of the +1.57): which shape of the 2-row launch streams best, one
# device call, one binary:
#   - staged (default): fused-norm launches as resident blocks, rows normalised once into
#     shared memory, 2 an SM; `FLASHRT_GEMV_STAGE=3`: two rows not staged (one block a tile,
#     per-tile norm, as at one row);
#   - `FLASHRT_GEMV_R2_FEATS=4`: `gemv_r2f4`, 4 outputs a block (75 registers, 3 an SM);
#   - fatbins of the gemv family built with other flags, loaded through FLASHRT_KERNELS_DIR
#     (.gpu/kv/<name>/gemv.fatbin, `bash scripts/build-kernel-variant.sh NAME gemv FLAGS`): `minb3`
#     (-DGEMV_MINB_R2=3: gemv_r2 at 80 registers), `pipe2` (-DGEMV_PIPE_MIN_ROWS=2: the next
#     chunk's weights requested before this chunk's multiply-adds, as past two rows),
#     `pipe2m2` (the same with gemv_r2f4 at 2 an SM, no spills), `f4m4` (gemv_r2f4 at 4 an SM).
# First the GPU tests (bit-identity of every option; each fatbin's batched rows).
# Ran once (2026-12-06 18:51, H100, benches/results/2026-12-06-h100-gemv-r2/): none beat the
# default, so gemv_r2f4, FLASHRT_GEMV_R2_FEATS and the three flags were removed afterwards;
# rerun from commit 119712e, which has them.
# Usage (repository root on the GPU machine, carry .gpupack): bash benches/run-gemv-r2-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-gemv-r2}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
KV="$ROOT/.gpu/kv"
"$BIN/cuda_model" --test-threads=1 gemv_tiles_compute batched_decode short_suffixes bf16_tracks_cpu_reference \
  >"$OUT/cuda_model-base.log" 2>&1 || status=1
echo "== tests base"; grep -hE 'test result|panicked|FAILED' "$OUT/cuda_model-base.log"
for v in minb3 pipe2 pipe2m2 f4m4; do
  FLASHRT_KERNELS_DIR="$KV/$v" "$BIN/cuda_model" --test-threads=1 gemv_tiles_compute batched_decode \
    >"$OUT/cuda_model-$v.log" 2>&1 || status=1
  echo "== tests $v"; grep -hE 'test result|panicked|FAILED' "$OUT/cuda_model-$v.log"
done
M27="$ROOT/models/qwen36-27b.toml"
b() {
  local name="$1"; shift
  run_bench "$name" "$FLASHRT" "$@" -- "$M27" --iters 1 --lengths 2048 --decode-steps 32 --batch 1,2,4
  grep -E '^ +2048 +[124] ' "$OUT/$name.log" | head -3
}
b base-1
b stage3 FLASHRT_GEMV_STAGE=3
b f4 FLASHRT_GEMV_R2_FEATS=4
b f4-stage3 FLASHRT_GEMV_R2_FEATS=4 FLASHRT_GEMV_STAGE=3
b minb3 FLASHRT_KERNELS_DIR="$KV/minb3"
b minb3-stage3 FLASHRT_KERNELS_DIR="$KV/minb3" FLASHRT_GEMV_STAGE=3
b pipe2 FLASHRT_KERNELS_DIR="$KV/pipe2"
b pipe2-f4 FLASHRT_KERNELS_DIR="$KV/pipe2" FLASHRT_GEMV_R2_FEATS=4
b pipe2m2-f4 FLASHRT_KERNELS_DIR="$KV/pipe2m2" FLASHRT_GEMV_R2_FEATS=4
b f4m4-f4 FLASHRT_KERNELS_DIR="$KV/f4m4" FLASHRT_GEMV_R2_FEATS=4
b f4m4-f4-stage3 FLASHRT_KERNELS_DIR="$KV/f4m4" FLASHRT_GEMV_R2_FEATS=4 FLASHRT_GEMV_STAGE=3
b base-2
exit $status
