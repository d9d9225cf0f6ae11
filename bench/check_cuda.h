// The GPU benchmarks' check of a CUDA (or, through runtime/protocol/gpu_api.h, HIP) runtime call: prints the call and
// the error and exits with status 1. A benchmark has nothing to recover, and exiting works inside lambdas and
// helpers, where returning an error code would not reach main. Layer: bench (not for library code, which returns
// absl::Status).
#pragma once

#include <cstdio>
#include <cstdlib>

#define LLEP_BENCH_CHECK_CUDA(expr)                                           \
  do {                                                                        \
    cudaError_t e_ = (expr);                                                  \
    if (e_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)
