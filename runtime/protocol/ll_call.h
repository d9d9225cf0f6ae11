// The arguments of one low-latency dispatch or combine, defined once: the Python bindings build them
// (server_hooks/bindings/call_from_addresses.h), the runtime validates them (runtime/validate.h), the CPU backend's
// phases (kernels/host/ll_host.h) read them and the GPU kernels' parameter blocks (kernels/cuda/ll_kernels.h)
// extend them. Host pointers for the CPU backend, device pointers for the GPU one. Adding an argument is one field
// here, its binding and its use. Layer: runtime/protocol (host and device).
// Shapes are DeepEP's low_latency_dispatch / low_latency_combine ones; all tensors row-major and contiguous.
#pragma once

#include <cstdint>

#include "runtime/protocol/ll_shape.h"

namespace llep::protocol {

/// Inputs and outputs of one dispatch (shapes as DeepEP's low_latency_dispatch; all row-major, contiguous).
struct DispatchCall {
  const uint16_t* x = nullptr;        ///< bf16 [num_tokens, H]
  const int64_t* topk_idx = nullptr;  ///< [num_tokens, num_topk], -1 = no expert
  /// Optional fp32 [num_tokens, num_topk] (llep keyword): carried to the expert ranks, whose combine then reduces a
  /// token's rows there and returns one row per (token, rank) (kernels/EXPERT_SIDE_COMBINE.md). Null: DeepEP's combine.
  const float* topk_weights = nullptr;
  /// The call carries topk_weights. Its own flag, not "topk_weights is non-null": a rank with no tokens (an empty
  /// micro-batch, whose tensor has no data) still carries them, and its peers check that every rank agrees.
  bool carries_weights = false;
  int num_tokens = 0;
  int num_topk = 0;
  DispatchMode mode;
  int layer = 0;  ///< MoE layer the call serves (llep keyword): per-layer expert receive counts (metrics_layout.h)
  // Outputs, written by the receive phase (must stay alive until Receive returns):
  void* recv_x = nullptr;           ///< fp8: uint8 [E/R, R*T, H]; bf16: uint16 [E/R, R*T, H]
  void* recv_scales = nullptr;      ///< fp8: float [E/R, H/128, R*T]; ue8m0: int32 [E/R, H/512, R*T]
  int32_t* recv_count = nullptr;    ///< [E/R]
  int32_t* src_info = nullptr;      ///< [E/R, R*T]
  int64_t* layout_range = nullptr;  ///< [E/R, R]
  int32_t* cumulative_local_expert_recv_stats = nullptr;  ///< optional [E/R], accumulated
  int64_t* wait_recv_cost_stats = nullptr;  ///< optional [R]: ns spent waiting for each source, accumulated
  /// Names this dispatch's token plan, which the GPU backend keeps for the combine of its handle (0: keep none).
  /// Unique per process (the Python Buffer's counter); carried in the handle (llep.buffer: handle[2].plan_key).
  uint64_t plan_key = 0;
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
  uint64_t plan_key = 0;  ///< the handle's dispatch's DispatchCall::plan_key (0: unknown; the GPU backend counts)
  /// The handle's dispatch carried topk_weights: reduce at the expert side. topk_weights must hold the same values
  /// (checked by the receive against the ones the dispatch kept).
  bool expert_reduced = false;
};

}  // namespace llep::protocol

namespace llep {
// The runtime and the bindings name them without the namespace.
using protocol::CombineCall;
using protocol::DispatchCall;
}  // namespace llep
