#!/usr/bin/env bash
# Run every cargo-fuzz target in fuzz/ for a bounded time (FUZZ_SECONDS, default 30 s each).
#
# The stable test suite carries the same loaders through seeded mutation tests as well
# (flashrt-runtime/tests/capsule_file.rs, flashrt-serve/tests/toml_mutations.rs).
# Findings land in fuzz/artifacts/<target>/ and make the script exit non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."

SECS="${FUZZ_SECONDS:-30}"
TARGETS=(capsule_file toml_model http_bodies chat_template)

# cargo-fuzz needs nightly-only compiler flags (-Z sanitizer). The machines here (and CI) have
# the stable toolchain only, so let the stable compiler accept them with RUSTC_BOOTSTRAP=1.
# FUZZ_TOOLCHAIN=nightly uses a nightly toolchain instead where one is installed.
if [ "${FUZZ_TOOLCHAIN:-stable}" = nightly ]; then
    CARGO=(cargo +nightly)
else
    export RUSTC_BOOTSTRAP=1
    CARGO=(cargo)
fi
if ! "${CARGO[@]}" fuzz --version >/dev/null 2>&1; then
    echo "fuzz-smoke: installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi
for t in "${TARGETS[@]}"; do
    echo "fuzz-smoke: ${t} for ${SECS} s"
    "${CARGO[@]}" fuzz run "$t" -- -max_total_time="$SECS" -rss_limit_mb=2048 -max_len=65536
done
echo "fuzz-smoke: ${#TARGETS[@]} targets ran ${SECS} s each without a finding"
