#!/usr/bin/env bash
# Run on the GPU machine: builds (scripts/gpu_build.sh) and runs the GPU tests, then every other test, with the
# carried libraries on the loader path (RUNPATH does not reach abseil's transitive dependencies). Prints a
# summary last; full logs go to $OUT (or ./gpu-test-logs) when set.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
LOGS="${OUT:-$PWD/gpu-test-logs}"
mkdir -p "$LOGS"
scripts/gpu_build.sh > "$LOGS/build.log" 2>&1 || { tail -40 "$LOGS/build.log"; exit 1; }
export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ctest --test-dir "$BUILD_DIR" -L gpu --output-on-failure > "$LOGS/gpu_tests.log" 2>&1; gpu_rc=$?
ctest --test-dir "$BUILD_DIR" -LE gpu -j "$(nproc)" --output-on-failure > "$LOGS/other_tests.log" 2>&1; other_rc=$?
grep -E "tests passed|Failed|\*\*\*" "$LOGS/gpu_tests.log" | head -20
grep -E "tests passed|Failed|\*\*\*" "$LOGS/other_tests.log" | head -20
exit $(( gpu_rc != 0 || other_rc != 0 ))
