#!/usr/bin/env bash
# README command (b): installs dependencies, builds everything (CUDA kernels included when nvcc exists) and runs
# all tests: unit tests, the module-dependency lint, fault tests and the 4-process end-to-end tests over
# libfabric shm and tcp;ofi_rxm. GPU tests arrive with the GPU issues and skip cleanly without a GPU. Then the AMD
# back end: every kernel and the GPU runtime compiled for gfx90a from the same sources (scripts/build_hip.sh), so a
# change that breaks HIP fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
ctest --test-dir "${LLEP_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)" "$@"
scripts/build_hip.sh
