#!/usr/bin/env bash
# Issue 16, one device call (2026-12-07): the fused one-row MoE block (`FLASHRT_MOE_FUSE_DOWN`,
# kernels/moe_small.cu `moe_updown1`) and the MoE prefetch (`FLASHRT_MOE_PREFETCH_MB`) on the
# 35B-A3B step next to evict-first alone and the build without it (benches/run-moe-prefetch-h200.sh),
# the attention / Gated DeltaNet families without io.len before the wait (`.gpu/kv/head`) and
# the gemv family with evict-first weights (`.gpu/kv/gef`: -DGEMV_EVICT_FIRST=1) on the 27B
# shape in bf16 and FP8, then the whole cuda_model suite with both options on (the fused
# kernel only if its own test passed first: a kernel whose blocks wait on each other can hang).
# Usage (repository root on the GPU machine, carry .gpupack):
#   [REPS27=1] [OPS=0: 1 also runs cuda_ops whole] [CM_FILTER="names": cuda_model only those] bash benches/run-moe-fuse-h200.sh [OUT]
set -uo pipefail
OUT="${1:-${OUT:-benches/results/latest-moe-fuse}}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=benches/h200-common.sh
source "$ROOT/benches/h200-common.sh"
head -1 "$OUT/device.txt"
O=$OUT
timeout 40 "$ROOT/.gpu/extra/moe_micro" > $O/moe_micro.log 2>&1; grep -iE 'bits|chain' $O/moe_micro.log | cut -c1-72
timeout 150 $BIN/cuda_model --test-threads=1 moe_fused_down moe_prefetch_changes > $O/new-tests.log 2>&1; echo "new tests rc=$?"; grep -hE 'test result|panicked|FAILED|bit-identical' $O/new-tests.log
FUSE=0; grep -q "test result: ok. 2 passed" $O/new-tests.log && FUSE=1
K=$ROOT/.gpu/kv
TESTS=0 REPS=2 MBS="32" EXTRA="fuse:FLASHRT_MOE_PREFETCH_MB=32,FLASHRT_MOE_FUSE_DOWN=$FUSE fuse-pf0:FLASHRT_MOE_FUSE_DOWN=$FUSE noiow:FLASHRT_KERNELS_DIR=$K/head,FLASHRT_MOE_PREFETCH_MB=32 gef:FLASHRT_KERNELS_DIR=$K/gef,FLASHRT_MOE_PREFETCH_MB=32" timeout 150 bash benches/run-moe-prefetch-h200.sh $O
for i in $(seq 1 "${REPS27:-1}"); do for c in "base:X=1" "gef:FLASHRT_KERNELS_DIR=$K/gef" "noiow:FLASHRT_KERNELS_DIR=$K/head"; do n=${c%%:*}; run_bench 27b-$n-$i $FLASHRT ${c#*:} -- models/qwen36-27b.toml --iters 1 --lengths 2048 --decode-steps 32 --batch 1 >/dev/null; echo "27b $n $i: $(grep -hE 'batch 1:' $O/27b-$n-$i.log | head -1 | cut -c17-)"; done; for c in "base:X=1" "gef:FLASHRT_KERNELS_DIR=$K/gef"; do n=${c%%:*}; run_bench 27b8-$n-$i $FLASHRT ${c#*:} -- models/qwen36-27b.toml --iters 1 --lengths 2048 --decode-steps 32 --batch 1 --quantize fp8 >/dev/null; echo "27b fp8 $n $i: $(grep -hE 'batch 1:' $O/27b8-$n-$i.log | head -1 | cut -c17-)"; done; done
FLASHRT_MOE_PREFETCH_MB=32 FLASHRT_MOE_FUSE_DOWN=$FUSE timeout 200 $BIN/cuda_model --test-threads=1 ${CM_FILTER:-} > $O/cuda_model.log 2>&1; echo "cuda_model (fuse $FUSE)"; grep -hE 'test result|panicked|FAILED' $O/cuda_model.log
if [ "${OPS:-0}" = 1 ]; then
  FLASHRT_MOE_PREFETCH_MB=32 FLASHRT_MOE_FUSE_DOWN=$FUSE timeout 280 "$BIN/cuda_ops" --test-threads=1 >"$O/cuda_ops.log" 2>&1
  echo "cuda_ops"; grep -hE 'test result|panicked|FAILED' "$O/cuda_ops.log"
fi
exit $status
