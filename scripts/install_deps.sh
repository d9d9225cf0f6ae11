#!/usr/bin/env bash
# Installs exactly what llep needs to build and test on Debian 12 (idempotent; apt only when something is
# missing). CUDA is not an apt package here: when /usr/local/cuda exists the build compiles the kernels with it.
set -euo pipefail

PACKAGES=(
  cmake ninja-build g++ make pkg-config python3   # build
  git clang-format                                # lint: formatting check (clang-format 14 on Debian 12)
  libabsl-dev                                     # Status/StatusOr, containers, synchronization, flags
  libgtest-dev libgmock-dev                       # tests (GTest + GMock CMake configs)
  libbenchmark-dev                                # micro-benchmarks
  libfabric-dev libfabric-bin                     # CPU proxy transport (shm, tcp;ofi_rxm, verbs, efa)
  libibverbs-dev                                  # native RC backend
  python3-dev pybind11-dev                        # the llep Python package's native module
  python3-torch python3-pytest                    # Python API tests (Debian's CPU-only torch 1.13)
  python3-pip python3-setuptools python3-wheel    # pip install --no-build-isolation . (pyproject.toml)
  prometheus-cpp-dev                              # metrics exporter (prometheus-cpp 1.0.1 + civetweb)
  prometheus                                      # metrics CI test: a real Prometheus scrapes the exporters
  hipcc libamdhip64-dev                           # the LLEP_GPU=hip build (ROCm 5.2, clang-15, gfx90a), CI compile
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install_deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  SUDO="sudo"
fi
echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
