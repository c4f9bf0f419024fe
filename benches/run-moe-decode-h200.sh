#!/usr/bin/env bash
# The 35B-A3B shape's decode step, the committed moe kernel family against variants of it
# (scripts/build-kernel-variant.sh NAME moe [FLAGS], or a family built from an older tree, in
# .gpu/kv/NAME, carried as .gpupack/kv.tar and loaded with FLASHRT_KERNELS_DIR). One device
# call, one binary, the variants alternated. (Its 2026-12-07 run also compared a
# shared-expert prefetch option and a `-DMOE_UP_MINB` build, both removed after measuring no
# gain; benches/RESULTS.md.)
#   1. GPU tests: the MoE tests, the fixtures against transformers (f32) and bf16 against the
#      CPU reference.
#   2. `flashrt bench` on models/qwen36-35b-a3b.toml at 2048, one row, the committed kernels
#      and each variant in VARIANTS (names under .gpu/kv), REPS times; BATCH=1 adds
#      `--batch 1,2,4,8` for the committed kernels (141 GB cards).
#   0. (first) every MoE microbenchmark carried in .gpu/extra (benches/kernels/moe_micro.cu:
#      `moe_micro*` timings, `moe_probe*` built with -DFLASHRT_PROBE for the phase stamps; a
#      variant's build named moe_micro_<variant> prints its `bits` for comparison).
# Usage (repository root on the GPU machine, carry .gpupack):
#   [VARIANTS="old"] [REPS=2] [BATCH=0] [TESTS=0] [MICRO=0] bash benches/run-moe-decode-h200.sh OUT
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-moe-decode}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
if [ "${MICRO:-1}" != 0 ]; then
  for m in "$ROOT"/.gpu/extra/moe_micro* "$ROOT"/.gpu/extra/moe_probe*; do
    [ -x "$m" ] || continue
    n="$(basename "$m")"
    timeout 120 "$m" >"$OUT/$n.log" 2>&1 || status=1
    echo "== $n"; cat "$OUT/$n.log"
  done
fi
if [ "${TESTS:-1}" != 0 ]; then
  "$BIN/cuda_model" --test-threads=1 moe_ fixtures_f32_match_transformers bf16_tracks_cpu_reference \
    >"$OUT/cuda_model-moe.log" 2>&1 || status=1
  echo "== tests"; grep -hE 'test result|panicked|FAILED|bit-identical' "$OUT/cuda_model-moe.log"
fi
M35="$ROOT/models/qwen36-35b-a3b.toml"
for i in $(seq 1 "${REPS:-2}"); do
  for name in committed ${VARIANTS:-}; do
    envs=()
    [ "$name" != committed ] && envs=("FLASHRT_KERNELS_DIR=$ROOT/.gpu/kv/$name")
    run_bench "35b-$name-$i" "$FLASHRT" "${envs[@]}" -- "$M35" --iters 1 --lengths 2048 --decode-steps 64 --batch 1
    grep -hE 'batch 1:' "$OUT/35b-$name-$i.log" | head -1
  done
done
if [ "${BATCH:-0}" = 1 ]; then
  run_bench 35b-batch "$FLASHRT" -- "$M35" --iters 1 --lengths 2048 --decode-steps 32 --batch 1,2,4,8
  grep -E '^ +2048 +[1248] ' "$OUT/35b-batch.log" | head -4
fi
exit $status
