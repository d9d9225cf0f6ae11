#include "kernels/host/route_plan.h"

#include <algorithm>

namespace llep::kernels {

void BuildRoutePlan(const protocol::LlShape& shape, const int64_t* topk_idx, int num_tokens, int num_topk,
                    RoutePlan* plan) {
  const int R = shape.num_ranks, E_loc = shape.num_local_experts();
  plan->num_tokens = num_tokens;
  plan->num_topk = num_topk;
  plan->num_ranks = R;
  plan->num_local_experts = E_loc;
  plan->entries.assign(static_cast<size_t>(num_tokens) * num_topk, RouteEntry{});
  plan->counts.assign(static_cast<size_t>(R) * E_loc, 0);
  plan->tokens_per_dst.assign(R, 0);
  plan->rows_per_dst.assign(R, 0);
  plan->slot.assign(static_cast<size_t>(num_tokens) * R, -1);

  for (int t = 0; t < num_tokens; ++t) {
    for (int k = 0; k < num_topk; ++k) {
      const int64_t g = topk_idx[static_cast<size_t>(t) * num_topk + k];
      if (g < 0) continue;
      RouteEntry& e = plan->entries[static_cast<size_t>(t) * num_topk + k];
      e.dst_rank = static_cast<int32_t>(g / E_loc);
      e.local_expert = static_cast<int32_t>(g % E_loc);
      // Counting in token order makes row_in_block the token's rank among those selecting g.
      e.row_in_block = plan->counts[static_cast<size_t>(e.dst_rank) * E_loc + e.local_expert]++;
      ++plan->rows_per_dst[e.dst_rank];
      int32_t& s = plan->slot[static_cast<size_t>(t) * R + e.dst_rank];
      if (s < 0) s = plan->tokens_per_dst[e.dst_rank]++;
    }
  }
  // pos = exclusive prefix of counts over local experts of the destination + row_in_block.
  std::vector<int32_t> prefix(static_cast<size_t>(R) * E_loc, 0);
  for (int d = 0; d < R; ++d) {
    int32_t acc = 0;
    for (int le = 0; le < E_loc; ++le) {
      prefix[static_cast<size_t>(d) * E_loc + le] = acc;
      acc += plan->counts[static_cast<size_t>(d) * E_loc + le];
    }
  }
  for (RouteEntry& e : plan->entries) {
    if (e.dst_rank >= 0) e.pos = prefix[static_cast<size_t>(e.dst_rank) * E_loc + e.local_expert] + e.row_in_block;
  }
}

}  // namespace llep::kernels
