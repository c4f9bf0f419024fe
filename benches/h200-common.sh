# Sourced by the benches/run-*-h200.sh scripts (after they set OUT and ROOT): unpack the
# carried binaries, record the device, and `bench27` for the 27B shape's `flashrt bench` runs.
#
# The binaries travel packed (`tar -cf - .gpu/bin .gpu/flashrt [...] | xz
# --lzma2=preset=6,dict=192MiB >.gpupack/p.tar.xz`: a dictionary spanning every binary stores
# their common embedded kernels once, ~20 MB for all of them; the device call carries
# `.gpupack/p.tar.xz`) and are unpacked here when .gpu is missing.
BIN="$ROOT/.gpu/bin"
FLASHRT="$ROOT/.gpu/flashrt"
if [ ! -x "$FLASHRT" ] && [ -f "$ROOT/.gpupack/p.tar.xz" ]; then
  tar -xJf "$ROOT/.gpupack/p.tar.xz" -C "$ROOT"
fi
# Kernel-family variants (`.gpu/kv/<name>/<family>.fatbin`, loaded with FLASHRT_KERNELS_DIR)
# travel as .gpupack/kv.tar (fatbins are compressed already).
if [ ! -d "$ROOT/.gpu/kv" ] && [ -f "$ROOT/.gpupack/kv.tar" ]; then
  tar -xf "$ROOT/.gpupack/kv.tar" -C "$ROOT"
fi
mkdir -p "$OUT"
export FLASHRT_FIXTURES="$ROOT/tests/fixtures" RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$OUT/device.txt" 2>&1
date -u +"%Y-%m-%dT%H:%M:%SZ" >>"$OUT/device.txt"
status=0
# run_bench NAME BIN [VAR=value ...] -- ARGS...: `BIN bench ARGS --random-weights --backend
# cuda` with those variables set, log and JSON under $OUT/NAME.*, its name printed; a failure
# sets status=1.
run_bench() {
  local name="$1" bin="$2"
  shift 2
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  env "${envs[@]}" timeout "${BENCH_TIMEOUT:-280}" "$bin" bench "$@" --random-weights --backend cuda \
    --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1 || status=1
  echo "== $name (${envs[*]})"
}
# bench27 NAME [VAR=value ...] -- ARGS...: run_bench on models/qwen36-27b.toml with the
# committed binary, its headline lines printed.
bench27() {
  local name="$1"
  shift
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  run_bench "$name" "$FLASHRT" "${envs[@]}" -- "$ROOT/models/qwen36-27b.toml" "$@"
  grep -E 'per step|restored TTFT [0-9]|^ +[0-9]+ +[1248] ' "$OUT/$name.log" | head -12
  grep -E '^\[bench --serve\] (prefix|chat)' "$OUT/$name.log" | head -14
}
# batch27 NAME [VAR=value ...]: the 27B shape's batched decode steps at 2048 (`--batch
# 1,2,4,8`) with the committed binary and those variables set, its table's rows printed.
batch27() {
  local name="$1"
  shift
  run_bench "$name" "$FLASHRT" "$@" -- "$ROOT/models/qwen36-27b.toml" --iters 1 --lengths 2048 \
    --decode-steps 32 --batch 1,2,4,8
  grep -E '^ +2048 +[1248] ' "$OUT/$name.log" | head -4
}
# bar16k: the bars' served command at 16k (issues 13 and 15): `bench27 bar` with the batched
# steps, stored 16k + 1 / + 32, streamed decode, CLIENTS clients at once (default 8; 4 on an
# 80 GB card) and a 16k newcomer, the store's demotions logged; its headline lines printed.
bar16k() {
  BENCH_TIMEOUT="${BENCH_TIMEOUT:-300}" bench27 bar RUST_LOG=info,flashrt_runtime::store=debug -- \
    --lengths 16384 --iters 1 --decode-steps 16 --batch 1,2,4,8 --serve --serve-suffixes 1,32 \
    --serve-runs 3 --serve-clients "${CLIENTS:-8}" --serve-newcomer 16384
  grep -E 'clients at once|newcomer|a 16384-token prompt|capsule store:|device memory' "$OUT/bar.log" | head -8
}
