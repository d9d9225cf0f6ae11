// What the two halves of GpuBuffer's implementation share (gpu_buffer_setup.cc: creation, peer mapping, proxy
// set-up, release; gpu_buffer.cc: the calls, the error record, metrics, close). Private to them. Layer: runtime.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda/ll_kernels.h"
#include "runtime/base/status_macros.h"
#include "runtime/protocol/ll_layout.h"

namespace llep::gpu_buffer_internal {

inline absl::Status CudaStatus(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

/// Bytes of the kernels' diagnostic timeline ([2 ops][num_ctas][kTracePoints] words).
inline size_t TraceBytes(int num_ctas) {
  return sizeof(uint64_t) * protocol::kNumLlOps * num_ctas * kernels::cuda::kTracePoints;
}

}  // namespace llep::gpu_buffer_internal

#define LLEP_CUDA_RETURN_IF_ERROR(expr) LLEP_RETURN_IF_ERROR(::llep::gpu_buffer_internal::CudaStatus((expr), #expr))
