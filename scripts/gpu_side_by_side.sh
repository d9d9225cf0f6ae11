#!/usr/bin/env bash
# On the GPU machine: llep vs DeepEP V1 in one run (bench/ll_side_by_side.py), and llep's baseline tree beside them —
# the one-round front end of scripts/gpu_sbs_rounds.sh (which builds, tests first, runs and compares).
# Carry .debs (scripts/fetch_gpu_debs.sh), .baseline (a copy of ../shared/baseline: DeepEP's sources and build
# script, git-ignored, never committed) and optionally .base (git archive REV --prefix=.base/ | tar -x: the llep
# before a change). With LLEP_SBS_TEST set (e.g. "--quick"), the working tree first runs tests/gpu/gpu_vs_cpu.py with
# those arguments, with LLEP_GRAPH_TEST_ARGS the graph soak, and benchmarks only if they pass. LLEP_SBS_ARGS go to the
# benchmark (e.g. "--tokens 1 8 --iters 100"); LLEP_SBS_VARIANT_ENV (e.g. "LLEP_NUM_CTAS=32") adds the working tree
# under that environment; LLEP_SBS_ROUNDS interleaves more rounds (default 1). Under $OUT: sbs_dual.json / .png (llep
# and DeepEP), logs.tgz (build, test and bench logs, every llep-only run's JSON, the comparison).
set -euo pipefail
cd "$(dirname "$0")/.."
variants=()
[ -d .base ] && variants+=(base=.base)
variants+=(new=new)
if [ -n "${LLEP_SBS_VARIANT_ENV:-}" ]; then
  read -ra extra <<< "$LLEP_SBS_VARIANT_ENV"
  variants+=("var=new:$(IFS=:; echo "${extra[*]}")")
fi
LLEP_ROUNDS="${LLEP_SBS_ROUNDS:-1}" LLEP_SBS_DEEPEP=1 exec scripts/gpu_sbs_rounds.sh "${variants[@]}"
