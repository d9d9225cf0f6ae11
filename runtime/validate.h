// Argument validation for every host entry point: bad input becomes absl::InvalidArgumentError with a message
// naming the offending value, never a crash or a corrupt buffer. Layer: runtime. Pure functions, any thread.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "runtime/protocol/ll_call.h"
#include "runtime/protocol/ll_shape.h"

namespace llep {

/// Shape limits (protocol/ll_shape.h), divisibility (H % 128, E % R, (R*T) % 4 like DeepEP for TMA-aligned
/// scale columns) and the region size reachable by FIFO offsets.
absl::Status ValidateShape(const protocol::LlShape& shape);
/// ValidateShape, and the bootstrap's rank count is the shape's: what every buffer's Create checks first.
absl::Status ValidateShapeForGroup(const protocol::LlShape& shape, int bootstrap_size);

/// use_ue8m0 needs round_scale, round_scale needs use_fp8, UE8M0 packing needs H % 512 == 0.
absl::Status ValidateDispatchMode(const protocol::LlShape& shape, const protocol::DispatchMode& mode);

/// 0 <= num_tokens <= T and 1 <= num_topk <= kMaxTopK.
absl::Status ValidateCounts(const protocol::LlShape& shape, int num_tokens, int num_topk);

/// What can be checked of a dispatch / combine without reading its tensors (so for device memory too): counts,
/// mode, required pointers. Both backends call these; the CPU backend also checks contents (below), the GPU
/// kernels check them in place and report through their error record.
absl::Status ValidateDispatchCall(const protocol::LlShape& shape, const DispatchCall& call, int num_layers);
absl::Status ValidateCombineCall(const protocol::LlShape& shape, const CombineCall& call);

/// Every id in [-1, E), and no expert twice in one token's row (it would need two rows for one slot).
absl::Status ValidateTopk(const protocol::LlShape& shape, const int64_t* topk_idx, int num_tokens, int num_topk);

/// A combine handle's layout_range [E/R, R] must describe blocks inside [0, R*T) whose per-rank totals fit the
/// combine receive area; anything else would make combine write out of bounds.
absl::Status ValidateLayoutRange(const protocol::LlShape& shape, const int64_t* layout_range);

}  // namespace llep
