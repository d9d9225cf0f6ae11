// The deterministic routing plan of one rank's tokens: where each (token, top-k slot) goes and lands.
// Layer: kernels/host. Built by the dispatch send phase (to address messages) and again by the combine receive
// phase (to find each slot's returned row) from the same topk_idx, so combine needs no state from dispatch.
//
// Definitions (the contract the CUDA kernels implement too):
//   g = topk_idx[t][k] (>= 0), dst = g / E_loc, le = g % E_loc
//   row_in_block(t, k) = #{t' < t : g in topk_idx[t']}    rows of an (le, src) block are in token order
//   slot(t, dst)       = #{t' < t : t' selects any expert on dst}   message slot on the destination
//   pos(t, k)          = sum_{le' < le} count(dst, le') + row_in_block(t, k)
// pos is where the expert rank returns that row in the home rank's combine receive area; the expert rank
// computes the same number from layout_range counts (combine send), so both sides agree without messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "runtime/protocol/ll_shape.h"

namespace llep::kernels {

struct RouteEntry {
  int32_t dst_rank = -1;  ///< -1: slot skipped (topk id -1).
  int32_t local_expert = 0;
  int32_t row_in_block = 0;
  int32_t pos = 0;  ///< combine position (see above); valid after Finalize.
};

struct RoutePlan {
  int num_tokens = 0;
  int num_topk = 0;
  int num_ranks = 0;
  int num_local_experts = 0;
  std::vector<RouteEntry> entries;      ///< [t * num_topk + k]
  std::vector<int32_t> counts;          ///< [dst * E_loc + le]: tokens this rank sends to (dst, le)
  std::vector<int32_t> tokens_per_dst;  ///< [dst]: distinct tokens (messages) sent to dst
  std::vector<int32_t> rows_per_dst;    ///< [dst]: selections sent to dst = rows it returns in combine
  std::vector<int32_t> slot;            ///< [t * num_ranks + dst]: message slot of t on dst, or -1

  const RouteEntry& at(int t, int k) const { return entries[static_cast<size_t>(t) * num_topk + k]; }
};

/// Builds the plan. Preconditions (checked by runtime/validate.h): ids in [-1, E), no id twice in a row.
void BuildRoutePlan(const protocol::LlShape& shape, const int64_t* topk_idx, int num_tokens, int num_topk,
                    RoutePlan* plan);

}  // namespace llep::kernels
