#!/usr/bin/env bash
# README command (b): installs dependencies, builds everything (CUDA kernels included when nvcc exists) and runs
# all tests: unit tests, the module-dependency lint, fault tests and the 4-process end-to-end tests over
# libfabric shm and tcp;ofi_rxm. GPU tests arrive with the GPU issues and skip cleanly without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
ctest --test-dir "${LLEP_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)" "$@"
