#!/usr/bin/env bash
# On the GPU machine: Nsight Compute on one hook-mode round (dispatch send, dispatch receive, combine send, combine
# receive) of llep and, when .baseline is carried, DeepEP, at each T of LLEP_NCU_TOKENS (default "1 128"), driven by
# bench/hook_loop.py (no torch profiler, which would hold CUPTI). Writes under $OUT: ncu_<system>_T<T>.csv (raw page:
# warp-state stall breakdown, instruction counts, duration per launch) and sass_sizes.txt (SASS instructions per
# kernel of both modules). bench/ncu_summary.py turns the CSVs into the table RESULTS quotes.
# Carry .debs (and .baseline for DeepEP). Leaves the clocks alone (--clock-control none, device/METHOD.md).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
OUTDIR="${OUT:-$PWD/gpu-test-logs}"
mkdir -p "$OUTDIR"
LLEP_GPU_TARGETS="_llep llep_py_package" scripts/gpu_build.sh > "$OUTDIR/build.log" 2>&1 &
llep_pid=$!
deepep_path=
if [ -x .baseline/build_deepep.sh ]; then
  DEST=/tmp/deepep MAX_JOBS=10 .baseline/build_deepep.sh > "$OUTDIR/build_deepep.log" 2>&1 && deepep_path=/tmp/deepep
fi
wait $llep_pid || { tail -30 "$OUTDIR/build.log"; exit 1; }
export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PYTHONUNBUFFERED=1
systems=llep
[ -n "$deepep_path" ] && systems="llep deepep"
warmup=20
if [ -n "${LLEP_NCU_SOURCE:-}" ]; then
  # Per-instruction stall samples of llep at T=LLEP_NCU_SOURCE (source page, SASS with its source lines), and the
  # module's SASS with line info, so samples and code volume can be attributed to source lines (bench/ncu_source.py).
  T=$LLEP_NCU_SOURCE
  src_sys="${LLEP_NCU_SOURCE_SYSTEM:-llep}"  # or deepep (with .baseline)
  PYTHONPATH="$PWD/$BUILD_DIR/python${deepep_path:+:$deepep_path}" timeout 240 ncu --clock-control none \
    --kernel-name regex:'(dispatch|combine)' --launch-skip $((4 * warmup)) --launch-count 4 \
    --section SourceCounters --section WarpStateStats --import-source yes -o "$OUTDIR/src_T$T" -f \
    python3 bench/hook_loop.py --system "$src_sys" --tokens "$T" --warmup $warmup --rounds 2 > "$OUTDIR/src.err" 2>&1
  for i in 1 2 3 4; do
    ncu --import "$OUTDIR/src_T$T.ncu-rep" --launch-skip $((i - 1)) --launch-count 1 --page source --csv \
      --print-source sass > "$OUTDIR/src_T${T}_launch$i.csv" 2>> "$OUTDIR/src.err"
  done
  module="$PWD/$(ls "$BUILD_DIR"/python/llep/_llep*.so | head -1)"
  mkdir -p /tmp/cubin && (cd /tmp/cubin && cuobjdump -xelf all "$module" > /dev/null)
  for f in /tmp/cubin/*.cubin; do nvdisasm -g -c "$f" > "$OUTDIR/$(basename "$f").sass" 2>> "$OUTDIR/src.err"; done
  tar -czf "$OUTDIR/source.tgz" -C "$OUTDIR" $(cd "$OUTDIR" && ls src_T*_launch*.csv *.sass) src.err
  rm -f "$OUTDIR"/src_T*_launch*.csv "$OUTDIR"/*.sass "$OUTDIR"/*.ncu-rep
  ls -la "$OUTDIR"; head -c 3000 "$OUTDIR/src.err"
  exit 0
fi
for sys in $systems; do
  for T in ${LLEP_NCU_TOKENS:-1 128}; do
    PYTHONPATH="$PWD/$BUILD_DIR/python${deepep_path:+:$deepep_path}" timeout 240 ncu --clock-control none \
      --kernel-name regex:'(dispatch|combine)' --launch-skip $((4 * warmup)) --launch-count 4 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats \
      --section InstructionStats --section MemoryWorkloadAnalysis --csv --page raw --print-units base \
      python3 bench/hook_loop.py --system "$sys" --tokens "$T" --warmup $warmup --rounds 2 \
      > "$OUTDIR/ncu_${sys}_T${T}.csv" 2> "$OUTDIR/ncu_${sys}_T${T}.err" || tail -5 "$OUTDIR/ncu_${sys}_T${T}.err"
  done
done
sass_count() {  # SASS instructions per kernel function of a shared object
  cuobjdump -sass "$1" 2> /dev/null | awk '/Function :/ {f = $3} /^ +\/\*[0-9a-f]+\*\// {n[f]++}
    END {for (f in n) printf "%8d %s\n", n[f], f}' | sort -rn | head -12
}
{
  echo "== llep"; sass_count "$(ls "$BUILD_DIR"/python/llep/_llep*.so | head -1)"
  if [ -n "$deepep_path" ]; then echo "== DeepEP"; sass_count "$(ls $deepep_path/deep_ep_cpp*.so | head -1)"; fi
} > "$OUTDIR/sass_sizes.txt"
cat "$OUTDIR/sass_sizes.txt"
python3 bench/ncu_summary.py "$OUTDIR"/ncu_*.csv
