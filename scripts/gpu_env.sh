# Sourced by the GPU-machine scripts: safety variables, the private prefix of carried packages, the build dir.
# Never uses NVLink multicast; these keep NCCL/torch/NVSHMEM from doing so either.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PREFIX="${LLEP_DEPS_PREFIX:-$PWD/.deps}"
BUILD_DIR="${LLEP_BUILD_DIR:-build-gpu}"
LIBDIR="$PREFIX/usr/lib/x86_64-linux-gnu"
