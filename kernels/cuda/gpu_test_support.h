// What the kernels' GPU unit tests share: a check of a runtime call and whether a GPU is present (tests skip
// cleanly without one, so CI builds and lists them where no device exists).
#pragma once

#include <gtest/gtest.h>

#include "runtime/protocol/gpu_api.h"

#define ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << cudaGetErrorString(expr)

namespace llep::kernels::cuda {

inline bool HaveDevice() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

}  // namespace llep::kernels::cuda
