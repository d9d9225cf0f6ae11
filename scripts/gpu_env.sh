# Sourced by the GPU-machine scripts: safety variables, the private prefix of carried packages, the build dir.
# Never uses NVLink multicast; these keep NCCL/torch/NVSHMEM from doing so either.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PREFIX="${LLEP_DEPS_PREFIX:-$PWD/.deps}"
BUILD_DIR="${LLEP_BUILD_DIR:-build-gpu}"
LIBDIR="$PREFIX/usr/lib/x86_64-linux-gnu"

# For scripts whose results go under $OUT: OUTDIR, and LOGS inside it, packed into OUTDIR/logs.tgz at exit (the
# device returns a handful of files, not a tree).
gpu_logs_tgz() {
  OUTDIR="${OUT:-$PWD/gpu-test-logs}"
  LOGS="$OUTDIR/logs"
  mkdir -p "$LOGS"
  trap 'tar -czf "$OUTDIR/logs.tgz" -C "$OUTDIR" logs && rm -rf "$LOGS"' EXIT
}

# DeepEP V1 from .baseline (a copy of ../shared/baseline, git-ignored, never committed), built in the background
# into /tmp/deepep: start_deepep_build sets deepep_pid (empty without .baseline); wait_deepep_build then sets
# deepep_path (empty if it did not build, with the build log's tail printed).
start_deepep_build() {
  deepep_pid=
  if [ -x .baseline/build_deepep.sh ]; then
    DEST=/tmp/deepep MAX_JOBS=8 .baseline/build_deepep.sh > "$LOGS/build_deepep.log" 2>&1 &
    deepep_pid=$!
  fi
}
wait_deepep_build() {
  deepep_path=
  [ -n "$deepep_pid" ] && { wait "$deepep_pid" && deepep_path=/tmp/deepep || tail -20 "$LOGS/build_deepep.log"; }
}

# The working tree's Python package (LLEP_GPU_TARGETS), built in the background beside DeepEP's: start_llep_build LOG
# sets llep_pid; wait_llep_build LOG exits with the log's tail if the build failed, else exports the run environment
# (the carried libraries, unbuffered Python).
start_llep_build() {
  export LLEP_GPU_TARGETS="_llep llep_py_package"
  scripts/gpu_build.sh > "$1" 2>&1 &
  llep_pid=$!
}
wait_llep_build() {
  wait "$llep_pid" || { tail -30 "$1"; exit 1; }
  export LD_LIBRARY_PATH="$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PYTHONUNBUFFERED=1
}
