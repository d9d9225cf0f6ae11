#!/usr/bin/env bash
# README command (a), the main job: installs dependencies, builds, and runs the low-latency benchmark for the
# DeepSeek-V3 decode shape (T=128, hidden 7168, 256 experts, top-8, FP8 dispatch, BF16 combine) on 4 ranks.
# Today that is the CPU backend over libfabric on loopback (the GPU benchmark comes with the NVLink kernels);
# results are verified and printed as a table, JSON goes to bench/out/. Extra flags pass to ll_cpu_bench.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
BUILD_DIR="${LLEP_BUILD_DIR:-build}"
mkdir -p bench/out
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  echo "run_bench: GPUs present, but the GPU kernels are not built yet: running the CPU backend"
fi
"$BUILD_DIR/bench/ll_cpu_bench" --provider "${LLEP_PROVIDER:-shm}" --json bench/out/ll_cpu_bench.json "$@"
