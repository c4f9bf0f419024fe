#!/usr/bin/env bash
# Download the pure-Python wheels the transformers peer needs on the GPU machine (which has
# torch and transformers but no network): flash-linear-attention 0.6.0 and fla-core 0.6.0
# (their only other requirement, einops, is installed there). Into the git-ignored `.whl/`;
# carry it to the GPU machine and install there with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
grep -qxF '/.whl/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.whl/' >> "$ROOT/.git/info/exclude"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$ROOT/.whl" flash-linear-attention==0.6.0 fla-core==0.6.0
ls -la "$ROOT/.whl"
