#!/usr/bin/env bash
# Issue 7's benchmark, flashrt and its peer in ONE command on the GPU machine, so every ratio
# in benches/RESULTS.md compares figures from the same run:
#
#   1. `flashrt bench` on the Qwen3.6-27B shape (random bf16 weights, generated on the device):
#      cold and restored TTFT, snapshot/restore next to the copy floor, decode step next to the
#      weight-bandwidth floor, prefill next to the FLOP floor, per-kernel profiles;
#   2. `benches/peer_transformers.py`: Hugging Face transformers (+ flash-linear-attention's
#      Triton kernels when its wheels are on PYTHONPATH) on the same shape and lengths;
#   3. `benches/compare.py`: the side-by-side table and the issue's bars, checked.
#
# Usage (from the repository root on the GPU machine; binaries built elsewhere, see GPU.md;
# the peer's wheels fetched with benches/fetch-peer-wheels.sh and installed as it says):
#   bash benches/run-h200.sh [FLASHRT_BINARY] [OUT_DIR]
# Environment: LENGTHS (flashrt, default 2048,4096,8192,16384,32000), PEER_LENGTHS (default
# 2048,4096,8192,16384), ITERS (default 20).
set -euo pipefail

BIN="${1:-.gpu/flashrt}"
OUT="${2:-benches/results/latest}"
LENGTHS="${LENGTHS:-2048,4096,8192,16384,32000}"
PEER_LENGTHS="${PEER_LENGTHS:-2048,4096,8192,16384}"
ITERS="${ITERS:-20}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$OUT"

{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' 2>/dev/null || true
  python3 -c 'import fla; print("flash-linear-attention", fla.__version__)' 2>/dev/null || echo "flash-linear-attention: not found"
} | tee "$OUT/device.txt"

"$BIN" bench "$ROOT/models/qwen36-27b.toml" --random-weights --backend cuda \
  --lengths "$LENGTHS" --iters "$ITERS" --decode-steps "$ITERS" --profile \
  --json "$OUT/flashrt.json" 2>&1 | tee "$OUT/flashrt.log"

PYTHONUNBUFFERED=1 python3 "$ROOT/benches/peer_transformers.py" --lengths "$PEER_LENGTHS" \
  --decode-steps 10 --json "$OUT/peer.json" 2>&1 | tee "$OUT/peer.log"

python3 "$ROOT/benches/compare.py" "$OUT/flashrt.json" "$OUT/peer.json" | tee "$OUT/compare.md"
