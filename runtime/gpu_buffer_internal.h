// What the two halves of GpuBuffer's implementation share (gpu_buffer_setup.cc: creation, peer mapping, proxy
// set-up, release; gpu_buffer.cc: the calls, the error record, metrics, close). Private to them. Layer: runtime.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/ll_kernels.h"
#include "runtime/base/status_macros.h"
#include "runtime/protocol/gpu_api.h"
#include "runtime/protocol/ll_layout.h"

namespace llep::gpu_buffer_internal {

inline absl::Status CudaStatus(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

/// Bytes of the kernels' diagnostic timeline ([num_ctas][2 ops][kTracePoints] words).
inline size_t TraceBytes(int num_ctas) {
  return sizeof(uint64_t) * protocol::kNumLlOps * num_ctas * kernels::cuda::kTracePoints;
}

// The device workspace, in 64-bit words: [2 halves][2 ops][R] completion counters, the same shape of proxy-signal
// mirrors, [2 halves][E] proxy block counters (combine coalescing), one word holding the two 32-bit flags, then,
// 128-byte aligned (the kernels load its records in 16-byte words), the call state (ll_kernels.h LlDeviceContext,
// LlCallState), the launch counts of the G CTAs (LlCtaLaunches), then the dispatches' plans kept for their combines
// (ll_kernels.h CarriedPlanArea) and the messages received for expert-side combines (ExpertPlanArea). All of it starts
// zeroed (a zeroed plan header names no plan: keys start at 1).
struct Workspace {
  int64_t R, E, T, G;
  static Workspace Of(const protocol::LlShape& s, int num_ctas) {
    return Workspace{s.num_ranks, s.num_experts, s.max_tokens_per_rank, num_ctas};
  }
  int64_t mirrors() const { return int64_t{protocol::kNumHalves} * protocol::kNumLlOps * R; }
  int64_t blocks() const { return 2 * mirrors(); }
  int64_t flags() const { return blocks() + int64_t{protocol::kNumHalves} * E; }
  int64_t call_state_bytes() const { return protocol::AlignUp((flags() + 1) * 8, 128); }
  int64_t launches_bytes() const {
    return call_state_bytes() + static_cast<int64_t>(sizeof(kernels::cuda::LlCallState));
  }
  int64_t carried_bytes() const {
    return protocol::AlignUp(launches_bytes() + G * static_cast<int64_t>(sizeof(kernels::cuda::LlCtaLaunches)), 128);
  }
  int64_t expert_plans_bytes() const {
    return protocol::AlignUp(carried_bytes() + kernels::cuda::CarriedPlanArea{E, T}.bytes(), 128);
  }
  size_t bytes() const {
    return static_cast<size_t>(expert_plans_bytes() + kernels::cuda::ExpertPlanArea{R, T}.bytes());
  }
};

/// The shrink-mode device area (GpuBufferOptions::shrink), byte offsets: the mask (int32 [R]), the receive verdicts
/// (u64 [2 halves][2 ops][R], LlDeviceContext::verdicts), then the outputs the clean barrier's empty dispatch writes
/// (recv_count [E/R], layout_range [E/R][R], and one word each for src_info and recv_x, never written).
struct ShrinkArea {
  int64_t R, E_loc;
  int64_t verdicts() const { return protocol::AlignUp(4 * R, 16); }
  int64_t recv_count() const { return verdicts() + 8 * int64_t{protocol::kNumHalves} * protocol::kNumLlOps * R; }
  int64_t layout_range() const { return protocol::AlignUp(recv_count() + 4 * E_loc, 16); }
  int64_t src_info() const { return layout_range() + 8 * E_loc * R; }
  int64_t recv_x() const { return src_info() + 16; }
  size_t bytes() const { return static_cast<size_t>(recv_x() + 16); }
};

}  // namespace llep::gpu_buffer_internal

#define LLEP_CUDA_RETURN_IF_ERROR(expr) LLEP_RETURN_IF_ERROR(::llep::gpu_buffer_internal::CudaStatus((expr), #expr))
