// The arguments of one low-latency dispatch or combine, shared by the CPU backend (cpu_buffer.h) and the GPU
// backend (gpu_buffer.h): host pointers for the one, device pointers for the other. Layer: runtime.
// Shapes are DeepEP's low_latency_dispatch / low_latency_combine ones; all tensors row-major and contiguous.
#pragma once

#include <cstdint>

#include "runtime/protocol/ll_shape.h"

namespace llep {

/// Inputs and outputs of one dispatch (shapes as DeepEP's low_latency_dispatch; all row-major, contiguous).
struct DispatchCall {
  const uint16_t* x = nullptr;        ///< bf16 [num_tokens, H]
  const int64_t* topk_idx = nullptr;  ///< [num_tokens, num_topk], -1 = no expert
  int num_tokens = 0;
  int num_topk = 0;
  protocol::DispatchMode mode;
  // Outputs, written by the receive phase (must stay alive until Receive returns):
  void* recv_x = nullptr;           ///< fp8: uint8 [E/R, R*T, H]; bf16: uint16 [E/R, R*T, H]
  void* recv_scales = nullptr;      ///< fp8: float [E/R, H/128, R*T]; ue8m0: int32 [E/R, H/512, R*T]
  int32_t* recv_count = nullptr;    ///< [E/R]
  int32_t* src_info = nullptr;      ///< [E/R, R*T]
  int64_t* layout_range = nullptr;  ///< [E/R, R]
  int32_t* cumulative_local_expert_recv_stats = nullptr;  ///< optional [E/R], accumulated
  int64_t* wait_recv_cost_stats = nullptr;  ///< optional [R]: ns spent waiting for each source, accumulated
};

/// Inputs and outputs of one combine (shapes as DeepEP's low_latency_combine).
struct CombineCall {
  const uint16_t* x = nullptr;          ///< bf16 [E/R, R*T, H]; ignored when zero_copy
  bool zero_copy = false;               ///< rows were written into NextCombineBuffer() before this call
  const int64_t* topk_idx = nullptr;    ///< this rank's routing, [num_tokens, num_topk]
  const float* topk_weights = nullptr;  ///< [num_tokens, num_topk]
  int num_tokens = 0;
  int num_topk = 0;
  const int64_t* layout_range = nullptr;    ///< the dispatch handle's layout_range [E/R, R]
  uint16_t* out = nullptr;                  ///< bf16 [num_tokens, H]
  int64_t* wait_recv_cost_stats = nullptr;  ///< optional [R], ns, accumulated
};

}  // namespace llep
