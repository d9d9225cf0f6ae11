// Launcher for the GPU payload encoder: the first step of the dispatch send phase (quantise each token once into
// the staging slots of runtime/protocol/ll_layout.h). Layer: kernels/cuda; host-includable, no torch, no abseil.
// The kernel's name avoids "dispatch"/"combine": DeepEP-style profilers require exactly one kernel per op
// carrying those words (shared/spec/deepep-ll-api.md §8.1).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "runtime/protocol/ll_layout.h"

namespace llep::kernels::cuda {

struct EncodePayloadArgs {
  protocol::LlLayout layout;  ///< by value: the kernel computes every offset from it
  protocol::DispatchMode mode;
  uint32_t seq = 0;             ///< picks the half
  const uint16_t* x = nullptr;  ///< bf16 [num_tokens, H] on the device
  uint8_t* region = nullptr;    ///< this rank's LL region on the device
  int num_tokens = 0;
};

/// Encodes x into DispatchPayloadOffset(half, t, fp8) for every t < num_tokens. Stream-ordered, no host sync.
cudaError_t LaunchEncodePayloads(const EncodePayloadArgs& args, cudaStream_t stream);

}  // namespace llep::kernels::cuda
