#!/usr/bin/env bash
# Run the CUDA test binaries on a GPU machine and print a summary.
#
# Two halves, because the GPU machine has no Rust toolchain:
#
#   here (build machine):  bash scripts/gpu-check.sh --collect
#       builds `cargo test -p flashrt-runtime --features cuda --release --no-run`, copies the
#       cuda_* test executables into .gpu/bin/ (git-ignored). The reference fixtures travel
#       with the working tree (tests/fixtures).
#
#   there (GPU machine):   bash scripts/gpu-check.sh [DIR]
#       runs every executable in DIR/bin (default .gpu/bin) with FLASHRT_FIXTURES=tests/fixtures,
#       one test at a time with output shown, writes one log per binary plus summary.json to
#       $OUT (when set) or DIR/logs, and prints a table last. Exit status: 0 iff all passed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [ "${1:-}" = "--collect" ]; then
  set -e
  DIR="$ROOT/.gpu"
  mkdir -p "$DIR/bin"
  rm -f "$DIR"/bin/*
  cd "$ROOT"
  cargo test -p flashrt-runtime --features cuda --release --no-run --message-format=json 2>/dev/null \
    | python3 -c '
import json, os, shutil, sys
dst = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    exe = m.get("executable")
    if m.get("reason") == "compiler-artifact" and exe and m["target"]["name"].startswith("cuda_"):
        name = m["target"]["name"]
        shutil.copy2(exe, os.path.join(dst, name))
        print(f"collected {name} <- {exe}")
        # Debug info is most of the size; symbols stay for backtraces.
        os.system(f"strip --strip-debug {os.path.join(dst, name)} 2>/dev/null")
' "$DIR/bin"
  du -sh "$DIR"
  exit 0
fi

DIR="${1:-$ROOT/.gpu}"
BIN="$DIR/bin"
LOGS="${OUT:-$DIR/logs}"
mkdir -p "$LOGS"
if ! ls "$BIN"/* >/dev/null 2>&1; then
  echo "no test binaries in $BIN: run 'bash scripts/gpu-check.sh --collect' on the build machine first" >&2
  exit 2
fi
export FLASHRT_FIXTURES="${FLASHRT_FIXTURES:-$ROOT/tests/fixtures}"
export RUST_BACKTRACE=1

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi unavailable"
} | tee "$LOGS/device.txt"

rows=()
status=0
json="["
for exe in "$BIN"/*; do
  [ -x "$exe" ] || continue
  name="$(basename "$exe")"
  log="$LOGS/$name.log"
  start=$(date +%s.%N)
  "$exe" --test-threads=1 --nocapture >"$log" 2>&1
  rc=$?
  secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')
  passed=$(grep -Eo '[0-9]+ passed' "$log" | tail -1 | cut -d' ' -f1)
  failed=$(grep -Eo '[0-9]+ failed' "$log" | tail -1 | cut -d' ' -f1)
  skipped=$(grep -c '^SKIP ' "$log")
  passed=${passed:-0}; failed=${failed:-0}
  [ "$rc" -eq 0 ] || status=1
  verdict=$([ "$rc" -eq 0 ] && echo ok || echo FAIL)
  rows+=("$(printf '%-14s %6s %6s %7s %7s  %s' "$name" "$passed" "$failed" "$skipped" "$secs" "$verdict")")
  json+="{\"binary\":\"$name\",\"passed\":$passed,\"failed\":$failed,\"skipped\":$skipped,\"seconds\":$secs,\"exit\":$rc},"
  if [ "$rc" -ne 0 ]; then
    echo "---- $name failed (exit $rc); failing tests:"
    grep -E "^test .* FAILED|panicked at|^---- " "$log" | head -20
  fi
done
json="${json%,}]"
echo "$json" >"$LOGS/summary.json"

echo
echo "logs: $LOGS"
printf '%-14s %6s %6s %7s %7s  %s\n' binary passed failed skipped seconds result
for r in "${rows[@]}"; do echo "$r"; done
exit $status
