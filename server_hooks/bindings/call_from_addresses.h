// The one native entry point of a call: DispatchCall / CombineCall (runtime/protocol/ll_call.h) built from the
// integer addresses llep/buffer.py passes (tensors never cross as torch objects), bound once for both backends
// (DefCallMethods), so their dispatch / combine methods take the same arguments (the CPU backend ignores the stream
// handle) and llep/buffer.py has one call path. Layer: server_hooks/bindings.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>

#include "runtime/protocol/ll_call.h"

namespace llep::bindings {

template <typename T>
T* Ptr(uintptr_t addr) {
  return reinterpret_cast<T*>(addr);
}

inline DispatchCall DispatchCallFromAddresses(uintptr_t x, uintptr_t topk, std::optional<uintptr_t> weights,
                                              int num_tokens, int num_topk, bool use_fp8, bool round_scale,
                                              bool use_ue8m0, uintptr_t recv_x, uintptr_t recv_scales,
                                              uintptr_t recv_count, uintptr_t src_info, uintptr_t layout_range,
                                              uintptr_t cumulative_stats, uintptr_t wait_stats, int layer,
                                              uint64_t plan_key) {
  DispatchCall c;
  c.layer = layer;
  c.plan_key = plan_key;
  c.x = Ptr<const uint16_t>(x);
  c.topk_idx = Ptr<const int64_t>(topk);
  // None: no combine_weights; an address (0 for an empty batch's tensor): the call carries them.
  c.topk_weights = Ptr<const float>(weights.value_or(0));
  c.carries_weights = weights.has_value();
  c.num_tokens = num_tokens;
  c.num_topk = num_topk;
  c.mode = {use_fp8, round_scale, use_ue8m0};
  c.recv_x = Ptr<void>(recv_x);
  c.recv_scales = Ptr<void>(recv_scales);
  c.recv_count = Ptr<int32_t>(recv_count);
  c.src_info = Ptr<int32_t>(src_info);
  c.layout_range = Ptr<int64_t>(layout_range);
  c.cumulative_local_expert_recv_stats = Ptr<int32_t>(cumulative_stats);
  c.wait_recv_cost_stats = Ptr<int64_t>(wait_stats);
  return c;
}

inline CombineCall CombineCallFromAddresses(uintptr_t x, bool zero_copy, uintptr_t topk, uintptr_t weights,
                                            int num_tokens, int num_topk, uintptr_t layout_range, uintptr_t out,
                                            uintptr_t wait_stats, uint64_t plan_key, bool expert_reduced) {
  CombineCall c;
  c.plan_key = plan_key;
  c.expert_reduced = expert_reduced;
  c.x = Ptr<const uint16_t>(x);
  c.zero_copy = zero_copy;
  c.topk_idx = Ptr<const int64_t>(topk);
  c.topk_weights = Ptr<const float>(weights);
  c.num_tokens = num_tokens;
  c.num_topk = num_topk;
  c.layout_range = Ptr<const int64_t>(layout_range);
  c.out = Ptr<uint16_t>(out);
  c.wait_recv_cost_stats = Ptr<int64_t>(wait_stats);
  return c;
}

/// Defines `dispatch` and `combine` on a buffer binding whose Holder has
///   pybind11::object Dispatch(const DispatchCall&, bool split, uintptr_t stream)
///   pybind11::object Combine(const CombineCall&, bool split, uintptr_t stream)
/// (the pending operation when split, the hook's; else None). The positional order is llep/buffer.py's.
template <typename Holder, typename Class>
void DefCallMethods(Class& cls) {
  cls.def("dispatch",
          [](Holder& h, uintptr_t x, uintptr_t topk, std::optional<uintptr_t> weights, int num_tokens, int num_topk,
             bool use_fp8, bool round_scale, bool use_ue8m0, uintptr_t recv_x, uintptr_t recv_scales,
             uintptr_t recv_count, uintptr_t src_info, uintptr_t layout_range, uintptr_t cumulative_stats,
             uintptr_t wait_stats, int layer, uint64_t plan_key, bool split, uintptr_t stream) {
            return h.Dispatch(DispatchCallFromAddresses(x, topk, weights, num_tokens, num_topk, use_fp8, round_scale,
                                                        use_ue8m0, recv_x, recv_scales, recv_count, src_info,
                                                        layout_range, cumulative_stats, wait_stats, layer, plan_key),
                              split, stream);
          });
  cls.def("combine", [](Holder& h, uintptr_t x, bool zero_copy, uintptr_t topk, uintptr_t weights, int num_tokens,
                        int num_topk, uintptr_t layout_range, uintptr_t out, uintptr_t wait_stats, uint64_t plan_key,
                        bool expert_reduced, bool split, uintptr_t stream) {
    return h.Combine(CombineCallFromAddresses(x, zero_copy, topk, weights, num_tokens, num_topk, layout_range, out,
                                              wait_stats, plan_key, expert_reduced),
                     split, stream);
  });
  // Rank masking and recovery (DeepEP's enable_shrink API and clean_low_latency_buffer); `mask_out` is the address
  // of an int32 [num_ranks] tensor on the backend's device.
  cls.def("clean", [](Holder& h, uintptr_t stream) { h.Clean(stream); });
  cls.def("set_masked", [](Holder& h, int rank, bool masked, uintptr_t stream) { h.SetMasked(rank, masked, stream); });
  cls.def("query_masks", [](Holder& h, uintptr_t mask_out, uintptr_t stream) { h.QueryMasks(mask_out, stream); });
  cls.def("clear_masks", [](Holder& h, uintptr_t stream) { h.ClearMasks(stream); });
}

}  // namespace llep::bindings
