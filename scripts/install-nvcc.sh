#!/usr/bin/env bash
# Install the pinned CUDA 13.0 compiler (nvcc + cicc/ptxas + headers) from PyPI wheels into
# the git-ignored venv `.venv/nvcc` at the repository root. Idempotent: a second run only
# checks the pins. Prints the nvcc path and the environment build.rs needs.
#
# The versions are pinned to the H200 machine's driver (CUDA 13.0): an unpinned install drifts
# to a newer release whose output the 13.0 driver may reject (see ../shared/GPU.md).
#
# Layout the wheels produce (inside the venv's site-packages, all under nvidia/cu13/):
#   bin/nvcc, bin/ptxas, bin/fatbinary, bin/nvlink, ...   (nvidia-cuda-nvcc)
#   nvvm/bin/cicc, nvvm/libdevice/                          (nvidia-nvvm)
#   include/crt/*.h, include/cuda_runtime.h, cuda_bf16.h... (nvidia-cuda-crt, -runtime)
#   include/cccl/ (cub, thrust, cuda/std)                    (nvidia-cuda-cccl)
# nvcc finds all of these relative to its own directory (its nvcc.profile points at
# `$(_HERE_)/..`), so no CUDA_HOME is needed; it needs a host compiler (gcc) on PATH.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv/nvcc"
PYTHON="${PYTHON:-python3}"
PINS=(
  "nvidia-cuda-nvcc==13.0.88"
  "nvidia-nvvm==13.0.88"
  "nvidia-cuda-crt==13.0.88"
  "nvidia-cuda-runtime==13.0.96"
  "nvidia-cuda-cccl==13.0.85"
)

if [ ! -x "$VENV/bin/python" ]; then
  echo "creating venv $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi

# pip is a no-op when every pin is already satisfied.
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PINS[@]}"

CU="$("$VENV/bin/python" - <<'PY'
import os, nvidia
for p in nvidia.__path__:
    d = os.path.join(p, "cu13")
    if os.path.isfile(os.path.join(d, "bin", "nvcc")):
        print(d)
        break
PY
)"
if [ -z "$CU" ]; then
  echo "error: nvcc not found in the installed wheels under $VENV" >&2
  exit 1
fi
# Wheels install executables without +x on some pip versions; make sure they run.
chmod +x "$CU"/bin/* "$CU"/nvvm/bin/* 2>/dev/null || true

# A stable path for build.rs: .venv/nvcc/cuda -> site-packages/nvidia/cu13.
ln -sfn "$CU" "$VENV/cuda"

if ! command -v "${CXX:-g++}" >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then
  echo "warning: nvcc needs a host C++ compiler (gcc/g++) on PATH" >&2
fi

"$VENV/cuda/bin/nvcc" --version | tail -n 2 >&2
echo "nvcc: $VENV/cuda/bin/nvcc"
echo "build.rs finds it there by default; or set FLASHRT_NVCC=$VENV/cuda/bin/nvcc"
