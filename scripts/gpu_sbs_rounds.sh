#!/usr/bin/env bash
# Interleaved A/B rounds on the GPU machine, the method of bench/RESULTS.md since session 24: every variant built in
# parallel, correctness on the working tree first, then bench/ll_side_by_side.py --systems llep once per variant per
# round (variants interleaved, every other round in reverse order, so the machine's drift hits all of them), and
# bench/compare_rounds.py printing each variant against the first, round by round. Logs and JSON go into
# $OUT/logs.tgz; the comparison is printed last.
#
#   scripts/gpu_sbs_rounds.sh [NAME=TREE[:VAR=VALUE[:VAR=VALUE...]] ...]      (default: base=.base new=new)
#
# TREE is "new" (the working tree) or a directory holding a copy of the sources, made on the development machine and
# carried: `rm -rf .base && git archive REV --prefix=.base/ | tar -x` (.base, .base2, ...: git-ignored); to change such a
# copy use `patch -p1 -d .base2 < FILE` — `git apply` run inside the repository skips paths outside the current folder,
# so in .base2 it applies nothing and the variant silently equals its base (bench/RESULTS.md session 28). VAR=VALUE
# pairs set the variant's environment, e.g. off=new:LLEP_METRICS=0. Carry .debs (scripts/fetch_gpu_debs.sh) and the
# trees named. scripts/gpu_side_by_side.sh is the one-round front end of this script.
#   LLEP_ROUNDS          rounds (default 3)
#   LLEP_SBS_ARGS        benchmark arguments (default: the benchmark's own, every visible GPU a rank)
#   LLEP_SBS_TIMEOUT     seconds per benchmark run (default 300)
#   LLEP_SBS_TEST        gpu_vs_cpu.py arguments for the working tree first (e.g. "--quick --ranks 2"); a failure stops
#   LLEP_GRAPH_TEST_ARGS graph_test.py arguments for the working tree first (e.g. "--ranks 2 --steps 400")
#   LLEP_SBS_BAD_INPUTS=1 tests/python/test_bad_inputs.py --device cuda on the working tree first; a failure stops
#   LLEP_SBS_DEEPEP=1    also one llep + DeepEP run of the working tree at the end (carry .baseline: a copy of
#                        ../shared/baseline, never committed), saved as $OUT/sbs_dual.json and .png
#   LLEP_SBS_DUALS=1     every run with DeepEP beside it (--systems llep,deepep; carry .baseline), so each variant's
#                        runs carry their own DeepEP columns: the method of bench/RESULTS.md since session 39. The
#                        JSON files also go to $OUT (small), and bench/sbs_tables.py prints each variant's ranges
#                        with DeepEP's at the end, then each variant's settled receives (`sbs_tables.py settled`);
#                        `sbs_tables.py ratios $OUT/sbs_new_*.json` makes README's table
#   LLEP_SBS_DUAL_ENV    VAR=VALUE pairs (space-separated) for that run, e.g. LLEP_SBS_EXPERT_SIDE=1
#   LLEP_SBS_BUDGET_S    no run starts after this many seconds (default 540: the device's 10-minute command limit)
#   LLEP_SBS_EAGER=1     also every variant under CUDA_MODULE_LOADING=EAGER, as NAME_e: a second code placement
#                        (bench/RESULTS.md session 53), compared against the first variant like the others
#   LLEP_SBS_PLACEMENTS  MiB of device memory held before the buffers, one per round in turn (e.g. "0 2 4 6";
#                        LLEP_PLACEMENT_PAD_MB of bench/ll_side_by_side.py): every variant of a round runs at the same
#                        placement and each round at another, so the rounds sample where the data lands, which moves
#                        a small-T launch with its code unchanged (bench/RESULTS.md session 54). A variant's own
#                        LLEP_PLACEMENT_PAD_MB wins
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
gpu_logs_tgz
T0=$SECONDS
budget="${LLEP_SBS_BUDGET_S:-540}"
step() { echo "[$((SECONDS - T0)) s] $*"; }
left() { echo $((budget - (SECONDS - T0))); }

[ $# -gt 0 ] || set -- base=.base new=new
names=() trees=() envs=()
for spec in "$@"; do
  name="${spec%%=*}" rest="${spec#*=}"
  [ "$name" != "$spec" ] && [ -n "$name" ] && [ -n "$rest" ] || { echo "gpu_sbs_rounds: bad variant '$spec'" >&2; exit 2; }
  tree="${rest%%:*}" env_part=""
  [ "$tree" != "$rest" ] && env_part="${rest#*:}"
  [ "$tree" = new ] || [ -d "$tree" ] || { echo "gpu_sbs_rounds: no tree '$tree' (carry it)" >&2; exit 2; }
  names+=("$name") trees+=("$tree") envs+=("${env_part//:/ }")
done
# A second code placement of every variant (kernels/SMALL_T_CODE.md: a byte-identical kernel can move 10-18 % with
# where the driver loads the code): NAME_e, the same tree under eager module loading.
if [ "${LLEP_SBS_EAGER:-0}" = 1 ]; then
  n=${#names[@]}
  for ((i = 0; i < n; i++)); do
    names+=("${names[$i]}_e") trees+=("${trees[$i]}") envs+=("${envs[$i]:+${envs[$i]} }CUDA_MODULE_LOADING=EAGER")
  done
fi

# Builds: the working tree once, each other tree once, all in parallel (DeepEP beside them when asked).
start_llep_build "$LOGS/build_new.log"
declare -A build_pid=()
for tree in "${trees[@]}"; do
  [ "$tree" = new ] || [ -n "${build_pid[$tree]:-}" ] && continue
  ln -sfn "$PWD/.debs" "$tree/.debs"
  (cd "$tree" && LLEP_DEPS_PREFIX="$PWD/.deps" scripts/gpu_build.sh) > "$LOGS/build_${tree//\//_}.log" 2>&1 &
  build_pid[$tree]=$!
done
duals="${LLEP_SBS_DUALS:-0}"
{ [ "${LLEP_SBS_DEEPEP:-0}" = 1 ] || [ "$duals" = 1 ]; } && start_deepep_build
wait_llep_build "$LOGS/build_new.log"
for tree in "${!build_pid[@]}"; do
  wait "${build_pid[$tree]}" || { tail -30 "$LOGS/build_${tree//\//_}.log"; exit 1; }
done
step "built: ${trees[*]}"
pkg_of() { if [ "$1" = new ]; then echo "$PWD/$BUILD_DIR/python"; else echo "$PWD/$1/$BUILD_DIR/python"; fi; }
new_pkg="$(pkg_of new)"

if [ -n "${LLEP_SBS_TEST:-}" ]; then
  # shellcheck disable=SC2086
  PYTHONPATH="$new_pkg" timeout 300 python3 tests/gpu/gpu_vs_cpu.py $LLEP_SBS_TEST \
    --results "$LOGS/gpu_vs_cpu.jsonl" > "$LOGS/gpu_vs_cpu.log" 2>&1
  rc=$?; step "gpu_vs_cpu rc=$rc"; grep -E "FAIL|gpu_vs_cpu:" "$LOGS/gpu_vs_cpu.log" | tail -4
  [ $rc = 0 ] || { tail -30 "$LOGS/gpu_vs_cpu.log"; exit 1; }
fi
if [ -n "${LLEP_GRAPH_TEST_ARGS:-}" ]; then
  # shellcheck disable=SC2086
  PYTHONPATH="$new_pkg" timeout 200 python3 tests/gpu/graph_test.py $LLEP_GRAPH_TEST_ARGS \
    --results "$LOGS/graph_test.jsonl" > "$LOGS/graph_test.log" 2>&1
  rc=$?; step "graph soak rc=$rc"; grep -E "FAIL|graph_test:" "$LOGS/graph_test.log" | tail -3
  [ $rc = 0 ] || { tail -30 "$LOGS/graph_test.log"; exit 1; }
fi

if [ "${LLEP_SBS_BAD_INPUTS:-0}" = 1 ]; then
  PYTHONPATH="$new_pkg" timeout 200 python3 tests/python/test_bad_inputs.py --device cuda > "$LOGS/bad_inputs.log" 2>&1
  rc=$?; step "bad inputs rc=$rc"; tail -1 "$LOGS/bad_inputs.log"
  [ $rc = 0 ] || { tail -30 "$LOGS/bad_inputs.log"; exit 1; }
fi

args="${LLEP_SBS_ARGS:-}"
systems=llep deepep_pp=""
if [ "$duals" = 1 ]; then
  wait_deepep_build
  [ -n "$deepep_path" ] || { echo "gpu_sbs_rounds: LLEP_SBS_DUALS=1 but DeepEP did not build" >&2; exit 1; }
  systems=llep,deepep deepep_pp=":$deepep_path"
  step "DeepEP built"
fi
run_s() { local l; l=$(left); echo $((l < ${LLEP_SBS_TIMEOUT:-300} ? l : ${LLEP_SBS_TIMEOUT:-300})); }
read -ra placements <<< "${LLEP_SBS_PLACEMENTS:-0}"
for round in $(seq 1 "${LLEP_ROUNDS:-3}"); do
  placement="LLEP_PLACEMENT_PAD_MB=${placements[$(((round - 1) % ${#placements[@]}))]}"
  order=("${!names[@]}")  # odd rounds in the given order, even rounds reversed (a, b, b, a, a, b): neither variant
  [ $((round % 2)) = 0 ] && mapfile -t order < <(printf '%s\n' "${order[@]}" | tac)  # always first or after one
  for i in "${order[@]}"; do
    [ "$(left)" -gt 45 ] || { step "budget spent: round $round not finished"; break 2; }
    # shellcheck disable=SC2086
    env "$placement" ${envs[$i]} PYTHONPATH="$(pkg_of "${trees[$i]}")$deepep_pp" timeout "$(run_s)" \
      python3 bench/ll_side_by_side.py --systems "$systems" --json "$LOGS/sbs_${names[$i]}_$round.json" $args \
      > "$LOGS/sbs_${names[$i]}_$round.log" 2>&1
    step "${names[$i]} round $round ($placement) rc=$?"
    rm -f "$LOGS/sbs_${names[$i]}_$round.png"
    [ "$duals" = 1 ] && cp "$LOGS/sbs_${names[$i]}_$round.json" "$OUTDIR/" 2>/dev/null
  done
done

if [ "${LLEP_SBS_DEEPEP:-0}" = 1 ]; then
  [ "$duals" = 1 ] || wait_deepep_build
  if [ -n "$deepep_path" ] && [ "$(left)" -gt 45 ]; then
    # shellcheck disable=SC2086
    env ${LLEP_SBS_DUAL_ENV:-} PYTHONPATH="$new_pkg:$deepep_path" timeout "$(run_s)" python3 bench/ll_side_by_side.py \
      --systems llep,deepep \
      --json "$OUTDIR/sbs_dual.json" $args > "$LOGS/sbs_dual.log" 2>&1
    step "llep + DeepEP rc=$?"
  fi
fi
[ ${#names[@]} -gt 1 ] && python3 bench/compare_rounds.py "$LOGS" "${names[0]}" "${names[@]:1}" | tee "$LOGS/compare_rounds.txt"
if [ "$duals" = 1 ]; then
  python3 bench/sbs_tables.py ranges "$LOGS" "${names[@]}" | tee "$LOGS/ranges.txt"
  for name in "${names[@]}"; do  # each variant's settled receives against the DeepEP of its own runs
    echo "settled receives, $name:"
    python3 bench/sbs_tables.py settled --variant "$LOGS" "$name" | tee -a "$LOGS/settled.txt"
  done
fi
[ -f "$LOGS/sbs_dual.log" ] && sed -n '/^llep vs DeepEP/,$p' "$LOGS/sbs_dual.log"
exit 0
