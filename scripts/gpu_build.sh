#!/usr/bin/env bash
# Run on the GPU machine (Ubuntu 24.04 image, CUDA 13, torch's Python 3.12) from a clean copy of the repository
# plus .debs/ (scripts/fetch_gpu_debs.sh): unpacks the carried Debian packages into a private prefix, points
# CMake and pkg-config at it and builds for sm_90a (scripts/gpu_test.sh also runs the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
ARCH="${LLEP_CUDA_ARCH:-90a}"

ls .debs/*.deb >/dev/null 2>&1 || { echo "gpu_build: no .debs/ (run scripts/fetch_gpu_debs.sh first)" >&2; exit 1; }
mkdir -p "$PREFIX"
for f in .debs/*.deb; do dpkg -x "$f" "$PREFIX"; done
# pkg-config files say prefix=/usr: rebase them onto the private prefix.
find "$PREFIX" -name '*.pc' -exec sed -i "s|^prefix=/usr\$|prefix=$PREFIX/usr|" {} +
export PKG_CONFIG_PATH="$LIBDIR/pkgconfig:$PREFIX/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
# The Python package is built for the interpreter that holds torch there; pybind11 comes from its pip package.
py_args=()
if py="$(command -v python3)" && pb="$("$py" -m pybind11 --cmakedir 2>/dev/null)"; then
  py_args=(-DLLEP_PYTHON="$py" -Dpybind11_DIR="$pb")
fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_PREFIX_PATH="$PREFIX/usr" -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
  -DLLEP_REQUIRE_CUDA=ON "${py_args[@]}" "$@"
# LLEP_GPU_TARGETS limits the build (e.g. "_llep llep_py_package" for the Python package alone: ~1 minute
# instead of ~4 with every test binary).
# shellcheck disable=SC2086
cmake --build "$BUILD_DIR" -j "$(nproc)" ${LLEP_GPU_TARGETS:+--target $LLEP_GPU_TARGETS}
