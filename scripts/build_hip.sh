#!/usr/bin/env bash
# Builds llep's AMD back end (LLEP_GPU=hip, kernels/HIP_PORT.md) into ${LLEP_HIP_BUILD_DIR:-build-hip}: every GPU
# kernel, the GPU runtime, the GPU test and benchmark programs and the Python module llep._llep_hip, from the same sources as the
# CUDA build, for ${LLEP_HIP_ARCHITECTURES:-gfx90a} with Debian's ROCm 5.2 clang; then runs the checks that need no AMD
# GPU (the module loads under a ROCm torch and exports only its init function). Nothing here runs on an AMD GPU.
# Extra CMake arguments pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${LLEP_HIP_BUILD_DIR:-build-hip}"
cxx="$(command -v clang++-15 || command -v clang++)"
cc="$(command -v clang-15 || command -v clang)"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLLEP_GPU=hip \
  -DLLEP_HIP_ARCHITECTURES="${LLEP_HIP_ARCHITECTURES:-gfx90a}" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_C_COMPILER="$cc" \
  -DLLEP_BUILD_TESTS=ON -DLLEP_BUILD_BENCH=ON \
  "$@"
cmake --build "$BUILD_DIR" -j "$(nproc)" --target llep_kernels_gpu llep_runtime_gpu _llep_hip llep_py_package \
  cuda_kernels_test gpu_fifo_test fifo_gpu_bench
ctest --test-dir "$BUILD_DIR" --output-on-failure -R '^(hip_python_module|lint_module_exports)$'
