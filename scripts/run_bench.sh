#!/usr/bin/env bash
# README command (a), the main job: installs dependencies, builds, and runs the low-latency benchmark for the
# DeepSeek-V3 decode shape (T=128, hidden 7168, 256 experts, top-8, FP8 dispatch, BF16 combine) on 4 ranks.
# With >= 2 GPUs, torch with CUDA and a CUDA build it is the NVLink GPU benchmark (bench/ll_gpu_bench.py);
# otherwise the CPU backend over libfabric on loopback. Results are verified and printed as a table, JSON goes
# to bench/out/. Extra flags pass to ll_cpu_bench (CPU) or ll_gpu_bench.py (GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
BUILD_DIR="${LLEP_BUILD_DIR:-build}"
mkdir -p bench/out
py="${LLEP_PYTHON:-/usr/bin/python3}"
[ -x "$py" ] || py=python3
if command -v nvidia-smi >/dev/null && [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ] &&
  PYTHONPATH="$BUILD_DIR/python" "$py" -c 'import sys, torch, llep; sys.exit(0 if torch.cuda.device_count() >= 2 and llep._llep.HAVE_CUDA else 1)' 2>/dev/null; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  exec env PYTHONPATH="$BUILD_DIR/python" "$py" bench/ll_gpu_bench.py --json bench/out/ll_gpu_bench.json "$@"
fi
echo "run_bench: no usable GPUs (need >= 2, torch with CUDA, a CUDA build): CPU backend over libfabric"
"$BUILD_DIR/bench/ll_cpu_bench" --provider "${LLEP_PROVIDER:-shm}" --json bench/out/ll_cpu_bench.json "$@"
