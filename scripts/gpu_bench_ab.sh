#!/usr/bin/env bash
# Before/after benchmark in one run on the GPU machine (bench/RESULTS.md asks for both numbers from the same run).
# The baseline is a tree in .base/, made on the development machine and carried:
#     rm -rf .base && git archive REV --prefix=.base/ | tar -x      (then run with carry [".debs", ".base"])
# The working tree is the candidate. Both Python packages are built in parallel; with LLEP_AB_TEST set, the
# candidate first runs tests/gpu/gpu_vs_cpu.py with those arguments (e.g. "--quick") and no benchmark runs if it
# fails; then bench/ll_gpu_bench.py (the candidate's script for both, so the method is the same) runs
# base, new, base, new, ... for LLEP_AB_ROUNDS rounds (default 2) with LLEP_BENCH_ARGS, and
# bench/compare_runs.py prints the table. Logs and JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
LOGS="${OUT:-$PWD/gpu-test-logs}"
mkdir -p "$LOGS"
[ -d .base ] || { echo "gpu_bench_ab: no .base/ baseline tree (see the header)" >&2; exit 2; }
ln -sfn "$PWD/.debs" .base/.debs
export LLEP_GPU_TARGETS="_llep llep_py_package"
scripts/gpu_build.sh > "$LOGS/build_new.log" 2>&1 &
new_pid=$!
(cd .base && LLEP_DEPS_PREFIX="$PWD/.deps" scripts/gpu_build.sh) > "$LOGS/build_base.log" 2>&1 &
base_pid=$!
wait $new_pid || { tail -30 "$LOGS/build_new.log"; exit 1; }
wait $base_pid || { tail -30 "$LOGS/build_base.log"; exit 1; }
export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PYTHONUNBUFFERED=1
declare -A pkg=([base]="$PWD/.base/$BUILD_DIR/python" [new]="$PWD/$BUILD_DIR/python")
if [ -n "${LLEP_AB_TEST:-}" ]; then
  # shellcheck disable=SC2086
  PYTHONPATH="${pkg[new]}" timeout 400 python3 tests/gpu/gpu_vs_cpu.py --results "$LOGS/gpu_vs_cpu.jsonl" \
    $LLEP_AB_TEST > "$LOGS/gpu_vs_cpu.log" 2>&1
  rc=$?
  grep -E "FAIL|rank .*:|gpu_vs_cpu:" "$LOGS/gpu_vs_cpu.log" | head -30
  [ $rc = 0 ] || { tail -20 "$LOGS/gpu_vs_cpu.log"; exit 1; }
fi
# LLEP_AB_VARIANT_ENV (e.g. "LLEP_METRICS=0"): each round also runs the candidate with that environment ("var"),
# and a second table compares the candidate with it (var = base, candidate = new).
declare -A runs=([base]="" [new]="" [var]="")
pkg[var]="${pkg[new]}"
variants="base new"
[ -n "${LLEP_AB_VARIANT_ENV:-}" ] && variants="base var new"
for round in $(seq "${LLEP_AB_ROUNDS:-2}"); do
  for v in $variants; do
    json="$LOGS/bench_${v}_$round.json"
    extra=()
    [ "$v" = var ] && read -ra extra <<< "$LLEP_AB_VARIANT_ENV"
    # shellcheck disable=SC2086
    env "${extra[@]}" PYTHONPATH="${pkg[$v]}" timeout "${LLEP_BENCH_TIMEOUT:-200}" python3 bench/ll_gpu_bench.py \
      --no-baselines --json "$json" ${LLEP_BENCH_ARGS:-} > "$LOGS/bench_${v}_$round.log" 2>&1 ||
      { echo "gpu_bench_ab: $v round $round failed"; tail -20 "$LOGS/bench_${v}_$round.log"; exit 1; }
    runs[$v]+="$json,"
  done
done
python3 bench/compare_runs.py "base=${runs[base]}" "new=${runs[new]}" | tee "$LOGS/compare.txt"
if [ -n "${LLEP_AB_VARIANT_ENV:-}" ]; then
  echo "== candidate with $LLEP_AB_VARIANT_ENV (base column) vs candidate (new column)"
  python3 bench/compare_runs.py "base=${runs[var]}" "new=${runs[new]}" | tee "$LOGS/compare_variant.txt"
fi
