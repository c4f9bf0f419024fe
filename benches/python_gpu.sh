#!/usr/bin/env bash
# The Python-binding measurements of benches/RESULTS.md on a GPU machine, in one run:
#   1. per-step overhead of Python over Rust, demo model on the CPU backend;
#   2. the same on the 27B shape (random bf16 weights) on the CUDA backend;
#   3. the robot control loop on the 27B shape, Python beside the same work from Rust.
# The flashrt package must be importable: PYTHONPATH=DIR with DIR holding the unpacked CUDA
# wheel (`maturin build --release --features cuda -m flashrt-py/Cargo.toml`, unzipped).
# Figures go to $OUT (default benches/results/latest-python).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benches/results/latest-python}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/device.txt" || true
python3 -c 'import flashrt, sys; print(flashrt.__file__, sys.version)' | tee "$OUT/python.txt"
python3 benches/python_overhead.py --backend cpu --rounds 31 --steps 64 --json "$OUT/overhead-demo-cpu.json"
# the same with one CPU thread: no thread-pool wake-up jitter in the step itself
FLASHRT_CPU_THREADS=1 python3 benches/python_overhead.py --backend cpu --rounds 31 --steps 64 \
  --json "$OUT/overhead-demo-cpu-1thread.json"
python3 benches/python_overhead.py models/qwen36-27b.toml --random-weights --backend cuda \
  --rounds "${ROUNDS:-15}" --steps 32 --prompt-tokens 2048 --json "$OUT/overhead-27b-cuda.json"
python3 examples/python/robot_loop.py models/qwen36-27b.toml --random-weights --backend cuda \
  --hz 20 --ticks "${TICKS:-240}" --task-tokens 2048 --rust --json "$OUT/robot-loop-27b-cuda.json"
