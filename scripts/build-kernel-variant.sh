#!/usr/bin/env bash
# A kernel family's fatbin built with extra nvcc flags, for an A/B against one flashrt binary:
# the runtime loads `DIR/<family>.fatbin` in place of the embedded family when
# FLASHRT_KERNELS_DIR=DIR (flashrt-runtime/src/backend/cuda/kernels.rs).
#
#   bash scripts/build-kernel-variant.sh NAME FAMILY [NVCC FLAGS...]
#   e.g. bash scripts/build-kernel-variant.sh off gemv -DGEMV_ASYNC=0
#        -> .gpu/kv/off/gemv.fatbin; run with FLASHRT_KERNELS_DIR=.gpu/kv/off
#
# A family is every kernels/<family>*.cu whose name up to the first `_` is FAMILY (build.rs's
# grouping); the nvcc arguments are build.rs's. The binary and the variant must come from the
# same tree apart from the flags: the runtime resolves every entry point it knows at load.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NAME="${1:?variant name}" FAMILY="${2:?kernel family, e.g. gemv}"
shift 2
NVCC="${FLASHRT_NVCC:-$ROOT/.venv/nvcc/cuda/bin/nvcc}"
[ -x "$NVCC" ] || { echo "no nvcc at $NVCC: run scripts/install-nvcc.sh or set FLASHRT_NVCC" >&2; exit 2; }
OUTDIR="$ROOT/.gpu/kv/$NAME"
mkdir -p "$OUTDIR"
UNIT="$(mktemp --suffix=.cu)"
trap 'rm -f "$UNIT"' EXIT
for f in "$ROOT"/kernels/*.cu; do
  stem="$(basename "$f" .cu)"
  [ "${stem%%_*}" = "$FAMILY" ] && printf '#include "%s"\n' "$f" >>"$UNIT"
done
[ -s "$UNIT" ] || { echo "no kernels/$FAMILY*.cu" >&2; exit 2; }
"$NVCC" -fatbin -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=compute_90 \
  -Xfatbin -compress-all -I "$ROOT/kernels" "$@" "$UNIT" -o "$OUTDIR/$FAMILY.fatbin"
ls -l "$OUTDIR/$FAMILY.fatbin"
