#!/usr/bin/env bash
# On the GPU machine: llep vs DeepEP V1 in one run (bench/ll_side_by_side.py), and llep's baseline tree beside them.
# Carry .debs (scripts/fetch_gpu_debs.sh), .baseline (a copy of ../shared/baseline: DeepEP's sources and build
# script, git-ignored, never committed) and optionally .base (git archive REV --prefix=.base/ | tar -x: the llep
# before a change). Builds the three in parallel; with LLEP_SBS_TEST set (e.g. "--quick"), the working tree first
# runs tests/gpu/gpu_vs_cpu.py with those arguments, with LLEP_GRAPH_TEST_ARGS the graph soak, and benchmarks only
# if they pass. LLEP_SBS_ARGS go to the benchmark (e.g. "--tokens 1 8 --iters 100"). Everything lands under $OUT:
# sbs_new.json / .png (llep and DeepEP), sbs_base.json (the baseline llep), logs.tgz (build, test and bench logs);
# with LLEP_SBS_VARIANT_ENV (e.g. "LLEP_NUM_CTAS=32") also sbs_var.json: the working tree under that environment.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
gpu_logs_tgz
start_llep_build "$LOGS/build_new.log"
base_pid=
if [ -d .base ]; then
  ln -sfn "$PWD/.debs" .base/.debs
  (cd .base && LLEP_DEPS_PREFIX="$PWD/.deps" scripts/gpu_build.sh) > "$LOGS/build_base.log" 2>&1 &
  base_pid=$!
fi
start_deepep_build
wait_llep_build "$LOGS/build_new.log"
base_ok=0
[ -n "$base_pid" ] && { wait $base_pid && base_ok=1 || tail -20 "$LOGS/build_base.log"; }
wait_deepep_build
new_pkg="$PWD/$BUILD_DIR/python"
base_pkg="$PWD/.base/$BUILD_DIR/python"
nvidia-smi -L | tee "$LOGS/gpus.txt"
if [ -n "${LLEP_SBS_TEST:-}" ]; then
  # shellcheck disable=SC2086
  PYTHONPATH="$new_pkg" timeout 300 python3 tests/gpu/gpu_vs_cpu.py $LLEP_SBS_TEST > "$LOGS/gpu_vs_cpu.log" 2>&1
  rc=$?
  grep -E "FAIL|rank .*:|gpu_vs_cpu:" "$LOGS/gpu_vs_cpu.log" | tail -15
  [ $rc = 0 ] || { tail -20 "$LOGS/gpu_vs_cpu.log"; exit 1; }
fi
if [ -n "${LLEP_GRAPH_TEST_ARGS:-}" ]; then
  # shellcheck disable=SC2086
  PYTHONPATH="$new_pkg" timeout 240 python3 tests/gpu/graph_test.py $LLEP_GRAPH_TEST_ARGS > "$LOGS/graph_test.log" 2>&1
  rc=$?
  grep -E "PASS|FAIL|graph_test:" "$LOGS/graph_test.log" | tail -12
  [ $rc = 0 ] || { tail -20 "$LOGS/graph_test.log"; exit 1; }
fi
systems=llep
[ -n "$deepep_path" ] && systems=llep,deepep
# shellcheck disable=SC2086
PYTHONPATH="$new_pkg${deepep_path:+:$deepep_path}" timeout "${LLEP_SBS_TIMEOUT:-300}" python3 bench/ll_side_by_side.py \
  --systems $systems --json "$OUTDIR/sbs_new.json" ${LLEP_SBS_ARGS:-} > "$LOGS/sbs_new.log" 2>&1 ||
  { echo "ll_side_by_side (new) failed"; tail -30 "$LOGS/sbs_new.log"; exit 1; }
if [ $base_ok = 1 ]; then
  # shellcheck disable=SC2086
  PYTHONPATH="$base_pkg" timeout "${LLEP_SBS_TIMEOUT:-300}" python3 bench/ll_side_by_side.py --systems llep \
    --json "$OUTDIR/sbs_base.json" ${LLEP_SBS_ARGS:-} > "$LOGS/sbs_base.log" 2>&1 ||
    { echo "ll_side_by_side (base) failed"; tail -30 "$LOGS/sbs_base.log"; }
  python3 bench/compare_side_by_side.py "$OUTDIR/sbs_base.json" "$OUTDIR/sbs_new.json" | tee "$LOGS/compare.txt"
fi
if [ -n "${LLEP_SBS_VARIANT_ENV:-}" ]; then
  # The working tree again with extra environment (e.g. "LLEP_NUM_CTAS=32"): sbs_var.json, compared with sbs_new.json.
  read -ra extra <<< "$LLEP_SBS_VARIANT_ENV"
  # shellcheck disable=SC2086
  env "${extra[@]}" PYTHONPATH="$new_pkg" timeout "${LLEP_SBS_TIMEOUT:-300}" python3 bench/ll_side_by_side.py \
    --systems llep --json "$OUTDIR/sbs_var.json" ${LLEP_SBS_ARGS:-} > "$LOGS/sbs_var.log" 2>&1 ||
    { echo "ll_side_by_side (variant) failed"; tail -30 "$LOGS/sbs_var.log"; }
  echo "== variant $LLEP_SBS_VARIANT_ENV: base = working tree, new = with the variant"
  python3 bench/compare_side_by_side.py "$OUTDIR/sbs_new.json" "$OUTDIR/sbs_var.json" | tee "$LOGS/compare_var.txt"
fi
sed -n '/^llep vs DeepEP/,$p' "$LOGS/sbs_new.log"
