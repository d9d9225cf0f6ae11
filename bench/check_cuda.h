// The GPU benchmarks' checks of a CUDA (or, through runtime/protocol/gpu_api.h, HIP) runtime call and of an absl
// status (a runtime call of llep's): print the call and the error and exit with status 1. A benchmark has nothing to
// recover, and exiting works inside lambdas and helpers, where returning an error code would not reach main. Layer:
// bench (not for library code, which returns absl::Status).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#define LLEP_BENCH_CHECK_CUDA(expr)                                           \
  do {                                                                        \
    cudaError_t e_ = (expr);                                                  \
    if (e_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s failed: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

#define LLEP_BENCH_CHECK_OK(expr)                                                        \
  do {                                                                                   \
    const auto& s_ = (expr);                                                             \
    if (!s_.ok()) {                                                                      \
      std::fprintf(stderr, "%s failed: %s\n", #expr, std::string(s_.message()).c_str()); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)
