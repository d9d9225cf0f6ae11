#include "runtime/validate.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/base/status_macros.h"
#include "runtime/protocol/fifo_cmd.h"
#include "runtime/protocol/ll_layout.h"

namespace llep {

using protocol::LlShape;

absl::Status ValidateShape(const LlShape& s) {
  if (s.max_tokens_per_rank < 1 || s.max_tokens_per_rank > protocol::kMaxTokensPerRank) {
    return absl::InvalidArgumentError(absl::StrCat("num_max_dispatch_tokens_per_rank must be in [1, ",
                                                   protocol::kMaxTokensPerRank, "], got ", s.max_tokens_per_rank));
  }
  if (s.hidden <= 0 || s.hidden % protocol::kChannelsPerScale != 0 || s.hidden > protocol::kMaxHidden) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden must be a positive multiple of 128 up to ", protocol::kMaxHidden, ", got ", s.hidden));
  }
  if (s.num_ranks < 1 || s.num_ranks > protocol::kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_ranks must be in [1, ", protocol::kMaxRanks, "], got ", s.num_ranks));
  }
  if (s.num_experts < 1 || s.num_experts > protocol::kMaxExperts) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_experts must be in [1, ", protocol::kMaxExperts, "], got ", s.num_experts));
  }
  if (s.num_experts % s.num_ranks != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_experts (", s.num_experts, ") must be divisible by num_ranks (", s.num_ranks, ")"));
  }
  if (s.num_local_experts() > protocol::kMaxLocalExperts) {
    return absl::InvalidArgumentError(absl::StrCat("at most ", protocol::kMaxLocalExperts, " experts per rank"));
  }
  if (s.max_recv_rows() % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_ranks * num_max_dispatch_tokens_per_rank (", s.max_recv_rows(),
                                                   ") must be a multiple of 4: the column-major scale tensor's "
                                                   "stride must stay 16-byte aligned for TMA consumers"));
  }
  const protocol::LlLayout layout = protocol::ComputeLlLayout(s);
  if (static_cast<uint64_t>(layout.total_bytes) > protocol::kCmdMaxOffset) {
    return absl::ResourceExhaustedError(
        absl::StrCat("buffer of ", layout.total_bytes, " bytes exceeds the 64 GiB reach of proxy command offsets"));
  }
  return absl::OkStatus();
}

absl::Status ValidateShapeForGroup(const LlShape& s, int bootstrap_size) {
  LLEP_RETURN_IF_ERROR(ValidateShape(s));
  if (bootstrap_size != s.num_ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("bootstrap has ", bootstrap_size, " ranks but the shape says ", s.num_ranks));
  }
  return absl::OkStatus();
}

absl::Status ValidateDispatchMode(const LlShape& s, const protocol::DispatchMode& m) {
  if (m.use_ue8m0 && !m.round_scale) return absl::InvalidArgumentError("use_ue8m0 requires round_scale");
  if (m.round_scale && !m.use_fp8) return absl::InvalidArgumentError("round_scale requires use_fp8");
  if (m.use_ue8m0 && s.hidden % protocol::kChannelsPerPackedUe8m0 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("use_ue8m0 packs 4 scales per int32: hidden must be a multiple of 512, got ", s.hidden));
  }
  return absl::OkStatus();
}

absl::Status ValidateCounts(const LlShape& s, int num_tokens, int num_topk) {
  if (num_tokens < 0 || num_tokens > s.max_tokens_per_rank) {
    return absl::InvalidArgumentError(absl::StrCat("num_tokens (", num_tokens, ") must be in [0, ",
                                                   s.max_tokens_per_rank, "] (num_max_dispatch_tokens_per_rank)"));
  }
  if (num_topk < 1 || num_topk > protocol::kMaxTopK) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_topk must be in [1, ", protocol::kMaxTopK, "], got ", num_topk));
  }
  return absl::OkStatus();
}

absl::Status ValidateTopk(const LlShape& s, const int64_t* topk_idx, int num_tokens, int num_topk) {
  if (num_tokens > 0 && topk_idx == nullptr) return absl::InvalidArgumentError("topk_idx is null");
  for (int t = 0; t < num_tokens; ++t) {
    const int64_t* row = topk_idx + static_cast<size_t>(t) * num_topk;
    for (int k = 0; k < num_topk; ++k) {
      if (row[k] < -1 || row[k] >= s.num_experts) {
        return absl::InvalidArgumentError(
            absl::StrCat("topk_idx[", t, "][", k, "] = ", row[k], " is out of range [-1, ", s.num_experts, ")"));
      }
      for (int j = 0; j < k && row[k] >= 0; ++j) {
        if (row[j] == row[k]) {
          return absl::InvalidArgumentError(
              absl::StrCat("topk_idx[", t, "] selects expert ", row[k], " twice (slots ", j, " and ", k, ")"));
        }
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateLayoutRange(const LlShape& s, const int64_t* layout_range) {
  if (layout_range == nullptr) return absl::InvalidArgumentError("handle layout_range is null");
  const int R = s.num_ranks, E_loc = s.num_local_experts();
  const int64_t rows = s.max_recv_rows(), per_src = protocol::CombineRowsPerSource(s);
  std::vector<int64_t> per_rank(R, 0);
  for (int le = 0; le < E_loc; ++le) {
    for (int r = 0; r < R; ++r) {
      const int64_t v = layout_range[static_cast<size_t>(le) * R + r];
      const int64_t count = protocol::LayoutRangeCount(v), begin = protocol::LayoutRangeBegin(v);
      if (count > s.max_tokens_per_rank || begin < 0 || begin + count > rows) {
        return absl::InvalidArgumentError(absl::StrCat("handle layout_range[", le, "][", r, "] = ", v,
                                                       " does not describe a block of this buffer's layout"));
      }
      per_rank[r] += count;
    }
  }
  for (int r = 0; r < R; ++r) {
    if (per_rank[r] > per_src) {
      return absl::InvalidArgumentError(absl::StrCat("handle returns ", per_rank[r], " rows to rank ", r,
                                                     ", more than its tokens can have selected (", per_src, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateDispatchCall(const LlShape& shape, const DispatchCall& call, int num_layers) {
  if (absl::Status s = ValidateCounts(shape, call.num_tokens, call.num_topk); !s.ok()) return s;
  if (call.layer < 0 || call.layer >= num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", call.layer, " is outside [0, ", num_layers,
                     "): the buffer counts that many MoE layers (Buffer(metrics_layers=n) or LLEP_METRICS_LAYERS)"));
  }
  if (absl::Status s = ValidateDispatchMode(shape, call.mode); !s.ok()) return s;
  if (call.num_tokens > 0 &&
      (call.x == nullptr || call.topk_idx == nullptr || (call.carries_weights && call.topk_weights == nullptr))) {
    return absl::InvalidArgumentError(
        "dispatch x, topk_idx or combine_weights has no data (a null pointer: a meta tensor, or one without storage)");
  }
  if (call.recv_x == nullptr || call.recv_count == nullptr || call.src_info == nullptr ||
      call.layout_range == nullptr || (call.mode.use_fp8 && call.recv_scales == nullptr)) {
    return absl::InvalidArgumentError(
        "dispatch output buffer missing (recv_x, recv_scales, recv_count, src_info, layout_range)");
  }
  return absl::OkStatus();
}

absl::Status ValidateCombineCall(const LlShape& shape, const CombineCall& call) {
  if (absl::Status s = ValidateCounts(shape, call.num_tokens, call.num_topk); !s.ok()) return s;
  if (!call.zero_copy && call.x == nullptr)
    return absl::InvalidArgumentError("combine x has no data (a null pointer: a meta tensor, or one without storage)");
  if (call.layout_range == nullptr) return absl::InvalidArgumentError("combine layout_range is null");
  if (call.num_tokens > 0 && (call.out == nullptr || call.topk_weights == nullptr || call.topk_idx == nullptr)) {
    return absl::InvalidArgumentError(
        "combine out, topk_idx or topk_weights has no data (a null pointer: a meta tensor, or one without storage)");
  }
  return absl::OkStatus();
}

}  // namespace llep
