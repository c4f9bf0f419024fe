#!/usr/bin/env bash
# Every open bar's headline figures in one device call (H200; each part is skipped with
# PARTS="..." naming the others): `bar16k` of benches/h200-common.sh (the served 27B shape at
# 16k: stored prompt + 1 / 32 through HTTP, batched steps, 8 clients, a 16k newcomer), the
# stored 2k prompt's suffixes through HTTP (`s2k`), the 35B-A3B shape's decode and TTFT
# (`c35`) and the FP8 27B decode and restored TTFT beside bf16 (`f8`).
# Usage (repository root on the GPU machine, carry .gpupack/p.tar.xz):
#   OUT=DIR bash benches/run-bars-h200.sh
set -uo pipefail
OUT="${OUT:-benches/results/latest-bars}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
head -1 "$OUT/device.txt"
PARTS="${PARTS:-bar16k s2k c35 f8}"
for part in $PARTS; do
  case "$part" in
    bar16k) bar16k ;;
    s2k) bench27 s2k -- --lengths 2048 --iters 1 --decode-steps 8 --serve --serve-suffixes 1,32,256 \
      --serve-runs 3 ;;
    c35)
      run_bench c35 "$FLASHRT" -- "$ROOT/models/qwen36-35b-a3b.toml" --lengths 2048,16384 --iters 2 \
        --decode-steps 32
      grep -E 'per step|TTFT [0-9]|^ +[0-9]+ ' "$OUT/c35.log" | head -6 ;;
    f8) bench27 f8 -- --quantize fp8 --lengths 2048 --iters 2 --decode-steps 32 ;;
  esac
done
exit $status
