#!/usr/bin/env bash
# Run on the GPU machine: builds (scripts/gpu_build.sh), runs the GPU unit tests (ctest label gpu), the
# GPU-vs-CPU correctness matrix through the Python API (tests/gpu/gpu_vs_cpu.py), the same matrix (--quick) over the
# inter-node path (the GPUs split into 2 virtual nodes: NVLink and proxy peers in one launch), the CUDA-graph soak
# (tests/gpu/graph_test.py, arguments from LLEP_GRAPH_TEST_ARGS), then, with --bench, the GPU
# benchmark (bench/ll_gpu_bench.py), and with --all every other test too; --bench-only builds the Python
# package alone and runs just the benchmark. Prints a summary last; full logs go
# to $OUT (or ./gpu-test-logs). Extra arguments after -- go to gpu_vs_cpu.py (e.g. -- --quick --ranks 2).
# LLEP_GPU_TEST_STEPS picks the test steps (space-separated; default all): unit matrix proxy graph exports scrape
# shrink bad_inputs gemm pool sass. On 4 GPUs the full matrix and the proxy matrix alone took ~8 of the device's 10
# minutes a command (bench/RESULTS.md session 30): split such a run over calls, e.g. "unit matrix" then "proxy graph
# exports scrape". Each step's seconds and status go to $LOGS/steps.txt and the summary.
# shellcheck disable=SC2317  # the step_* and summary_* functions are called by name ("step_$s")
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
LOGS="${OUT:-$PWD/gpu-test-logs}"
mkdir -p "$LOGS"
bench=0 all=0 tests=1
while [ $# -gt 0 ]; do
  case "$1" in
    --bench) bench=1 ;;
    --all) all=1 ;;
    --bench-only) bench=1 tests=0; export LLEP_GPU_TARGETS="_llep llep_py_package" ;;
    --) shift; break ;;
    *) echo "gpu_test: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
all_steps="unit matrix proxy graph exports scrape shrink bad_inputs gemm pool sass"
steps=" ${LLEP_GPU_TEST_STEPS:-$all_steps} "
for s in $steps; do
  [[ " $all_steps " == *" $s "* ]] || { echo "gpu_test: unknown step '$s' (steps: $all_steps)" >&2; exit 2; }
done
scripts/gpu_build.sh > "$LOGS/build.log" 2>&1 || { tail -40 "$LOGS/build.log"; exit 1; }
export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$PWD/$BUILD_DIR/python${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L | tee "$LOGS/gpus.txt"
rc=0
export PYTHONUNBUFFERED=1
ngpu=$(nvidia-smi -L | wc -l)
# One function per test step; each writes its log under $LOGS.
step_unit() { ctest --test-dir "$BUILD_DIR" -L gpu --output-on-failure > "$LOGS/gpu_unit_tests.log" 2>&1; }
step_matrix() {
  timeout 420 python3 tests/gpu/gpu_vs_cpu.py --results "$LOGS/gpu_vs_cpu.jsonl" "$@" > "$LOGS/gpu_vs_cpu.log" 2>&1
}
step_proxy() {  # the same matrix (--quick) with the GPUs split into 2 virtual nodes
  [ "$ngpu" -ge 2 ] || { echo "NOT RUN: needs 2 or more GPUs (this machine has $ngpu)" > "$LOGS/gpu_vs_cpu_proxy.log"; return 0; }
  timeout 300 python3 tests/gpu/gpu_vs_cpu.py --quick --ranks "$ngpu" --ranks-per-node $((ngpu / 2)) \
    --results "$LOGS/gpu_vs_cpu_proxy.jsonl" > "$LOGS/gpu_vs_cpu_proxy.log" 2>&1
}
step_graph() {
  # shellcheck disable=SC2086
  timeout 300 python3 tests/gpu/graph_test.py --results "$LOGS/graph_test.jsonl" ${LLEP_GRAPH_TEST_ARGS:-} \
    > "$LOGS/graph_test.log" 2>&1
}
# Issue #15: the module of this toolchain exports its init function only and shares the process's C++ runtime;
# its exporter survives 1,000 scrapes under load with exact per-(layer, expert) counts.
step_exports() {
  python3 tests/lint/check_module_exports.py "$BUILD_DIR"/python/llep/_llep*.so > "$LOGS/module_exports.log" 2>&1
}
step_scrape() {  # one rank per GPU where the GPUs divide its 16 experts (issue #18: 4 and 8 GPUs), else 2 sharing
  local ranks=2
  case "$ngpu" in 4|8|16) ranks=$ngpu ;; esac
  timeout 300 python3 tests/python/test_metrics_scrape.py --device cuda --ranks "$ranks" > "$LOGS/metrics_scrape.log" 2>&1
}
# Rank masking (DeepEP's shrink scenario: ranks stop calling at dispatch, combine and clean) and recovery after a
# timeout without rebuilding the buffer.
step_shrink() { timeout 400 python3 tests/python/test_shrink.py --device cuda > "$LOGS/shrink.log" 2>&1; }
# The bad-input catalogue: every row a typed error, each followed by an exact round on the same buffer.
step_bad_inputs() { timeout 300 python3 tests/python/test_bad_inputs.py --device cuda > "$LOGS/bad_inputs.log" 2>&1; }
step_gemm() { timeout 300 python3 tests/gpu/grouped_gemm_test.py > "$LOGS/grouped_gemm.log" 2>&1; }
# Output reuse (llep/_output_pool.py) with this machine's torch, which has the counters CI's Debian torch lacks.
step_pool() { timeout 200 python3 tests/python/test_output_pool.py --device cuda > "$LOGS/output_pool.log" 2>&1; }
# The kernels' machine code: batched 16-byte loads stay in flight together (kernels/SMALL_T_CODE.md rule 13; the
# development machine has no disassembler).
step_sass() {
  local objs=("$BUILD_DIR"/kernels/CMakeFiles/llep_kernels_gpu.dir/cuda/ll_kernels*.cu.o)
  [ -e "${objs[0]}" ] || { echo "no kernel objects under $BUILD_DIR" > "$LOGS/sass_load_batches.log"; return 1; }
  local o  # one object per cuobjdump: given several, it printed no machine code
  for o in "${objs[@]}"; do cuobjdump -sass "$o" || exit 1; done |
    python3 tests/lint/check_sass_load_batches.py - > "$LOGS/sass_load_batches.log" 2>&1
}

want() { [ $tests = 1 ] && [[ "$steps" == *" $1 "* ]]; }
: > "$LOGS/steps.txt"
for s in $all_steps; do
  want "$s" || continue
  t0=$SECONDS
  "step_$s" "$@"
  r=$?
  echo "$s $((SECONDS - t0)) s rc=$r" >> "$LOGS/steps.txt"
  [ $r = 0 ] || rc=1
done
if [ $all = 1 ]; then
  ctest --test-dir "$BUILD_DIR" -LE gpu -j "$(nproc)" --output-on-failure > "$LOGS/other_tests.log" 2>&1 || rc=1
fi
if [ $bench = 1 ] && [ $rc = 0 ]; then
  timeout "${LLEP_BENCH_TIMEOUT:-300}" python3 bench/ll_gpu_bench.py --json "$LOGS/ll_gpu_bench.json" \
    ${LLEP_BENCH_ARGS:-} > "$LOGS/ll_gpu_bench.log" 2>&1 || rc=1
fi
# show STEP TITLE: the step's time and status, then its log's summary lines (summary_STEP), or that it was not selected.
summary_unit() { grep -E "tests passed|Failed|\*\*\*" "$LOGS/gpu_unit_tests.log" | head -20; }
summary_matrix() { grep -E "FAIL|rank .*:|gpu_vs_cpu:|Error|error" "$LOGS/gpu_vs_cpu.log" | head -40; }
summary_proxy() { grep -E "NOT RUN|FAIL|rank .*:|gpu_vs_cpu:|Error|error" "$LOGS/gpu_vs_cpu_proxy.log" | head -20; }
summary_graph() { grep -E "PASS|FAIL|rank .*:|graph_test:|Error" "$LOGS/graph_test.log" | head -30; }
summary_exports() { cat "$LOGS/module_exports.log"; }
summary_scrape() { tail -4 "$LOGS/metrics_scrape.log"; }
summary_shrink() { grep -E "PASS|FAIL|rank [0-9]" "$LOGS/shrink.log" | head -20; }
summary_bad_inputs() { grep -vE "^/|^\s+File|^Traceback" "$LOGS/bad_inputs.log" | tail -25; }
summary_gemm() { tail -5 "$LOGS/grouped_gemm.log"; }
summary_pool() { tail -5 "$LOGS/output_pool.log"; }
summary_sass() { tail -5 "$LOGS/sass_load_batches.log"; }
show() {
  if want "$1"; then
    echo "== $2 ($(grep "^$1 " "$LOGS/steps.txt" | cut -d' ' -f2-))"
    "summary_$1"
  else
    echo "== $2: not selected (LLEP_GPU_TEST_STEPS)"
  fi
}
if [ $tests = 1 ]; then
  show unit "GPU unit tests"
  show matrix "GPU vs CPU"
  show proxy "GPU vs CPU over 2 virtual nodes (proxy path)"
  show graph "CUDA graphs"
  show exports "Python module exports"
  show scrape "metrics scrape"
  show shrink "rank masking and recovery"
  show bad_inputs "bad-input catalogue"
  show gemm "engine grouped GEMM"
  show pool "output reuse (torch counters)"
  show sass "kernel machine code: batched loads in flight"
fi
[ $all = 1 ] && { echo "== other tests"; grep -E "tests passed|Failed|\*\*\*" "$LOGS/other_tests.log" | head -20; }
[ $bench = 1 ] && { echo "== benchmark"; tail -30 "$LOGS/ll_gpu_bench.log"; }
exit $rc
