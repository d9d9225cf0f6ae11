// The stand-alone diagnostics' (bench/experiments/*_probe.cu) check of a CUDA runtime call: prints the call, where,
// and the error, and returns 1 from main.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e_ = (x);                                                       \
    if (e_ != cudaSuccess) {                                                    \
      printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      return 1;                                                                 \
    }                                                                           \
  } while (0)
