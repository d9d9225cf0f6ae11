#!/usr/bin/env bash
# Configures and builds llep into ${LLEP_BUILD_DIR:-build}. CUDA kernels are compiled whenever nvcc exists
# (and then required, so a CUDA compile error fails the build); extra CMake arguments pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${LLEP_BUILD_DIR:-build}"

cuda_args=()
nvcc="$(command -v nvcc || true)"
[ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
if [ -n "$nvcc" ]; then
  cuda_args=(-DCMAKE_CUDA_COMPILER="$nvcc" -DLLEP_REQUIRE_CUDA=ON)
  echo "build: CUDA kernels with $nvcc"
else
  echo "build: no nvcc found; CUDA kernels skipped"
fi

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${cuda_args[@]}" "$@"
cmake --build "$BUILD_DIR" -j "$(nproc)"
