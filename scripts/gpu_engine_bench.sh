#!/usr/bin/env bash
# On the GPU machine: bench/engine_bench.py (llep.engine's decode step on llep, DeepEP and the NCCL all-to-all
# baseline). Carry .debs (scripts/fetch_gpu_debs.sh) and .baseline (a copy of ../shared/baseline, git-ignored): llep
# and DeepEP build in parallel; without .baseline the DeepEP runs are reported as failed. One rank per GPU by default
# (NCCL and DeepEP refuse two ranks on one GPU). LLEP_ENGINE_BENCH_ARGS go to the benchmark, e.g.
#   LLEP_ENGINE_BENCH_ARGS="--ranks 2 --model deepseek-v3-moe --layers 1 --batches 1 8 32 128" scripts/gpu_engine_bench.sh
# Under $OUT: engine.json, engine.png, logs.tgz (build and benchmark logs).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
gpu_logs_tgz
start_llep_build "$LOGS/build.log"
start_deepep_build
wait_llep_build "$LOGS/build.log"
wait_deepep_build
nvidia-smi -L | tee "$LOGS/gpus.txt"
# shellcheck disable=SC2086
PYTHONPATH="$PWD/$BUILD_DIR/python${deepep_path:+:$deepep_path}" python3 bench/engine_bench.py --device cuda \
  --json "$OUTDIR/engine.json" --png "$OUTDIR/engine.png" ${LLEP_ENGINE_BENCH_ARGS:-} > "$LOGS/engine_bench.log" 2>&1
rc=$?
sed -n '/^llep.engine decode step/,$p' "$LOGS/engine_bench.log"
[ $rc = 0 ] || tail -20 "$LOGS/engine_bench.log"
exit $rc
