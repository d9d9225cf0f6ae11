#!/usr/bin/env bash
# Run on the Debian 12 build machine: downloads the Debian packages the GPU machine's image lacks (abseil,
# libfabric headers, google-benchmark, prometheus-cpp + civetweb for metrics) into .debs/ (git-ignored, never committed). scripts/gpu_build.sh unpacks
# them there. Bookworm binaries run on Ubuntu 24.04's newer glibc/libstdc++.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(libabsl-dev libabsl20220623 libfabric-dev libfabric1 libbenchmark-dev libbenchmark1debian
          libgtest-dev libgmock-dev prometheus-cpp-dev libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0
          libcivetweb-dev libcivetweb1)
mkdir -p .debs
cd .debs
missing=()
for p in "${PACKAGES[@]}"; do ls "${p}"_*.deb >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get download "${missing[@]}" 2>/dev/null || { apt-get update -qq && apt-get download "${missing[@]}"; }
fi
ls -la
