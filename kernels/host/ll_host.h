// The low-latency dispatch and combine phases on CPU threads: the CPU backend and the oracle for GPU tests.
// Layer: kernels/host (depends on runtime/protocol and kernels/codec only). Called by runtime/cpu_buffer.cc on
// the caller's thread. Send and receive phases are separate functions, mirroring the two launches of the
// CUDA kernels (receive hooks). Waiting for signals is the caller's job; these functions never block, except
// FifoPush when a proxy ring is full.
//
// Peers are reached either directly (their region is mapped in this process: self today, CUDA IPC later), with
// data copies followed by a release store of the signal word, or through a proxy ring: one kWrite command per
// contiguous run of bytes, then one kSignal command (proxy/proxy.cc turns them into RDMA writes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/host/route_plan.h"
#include "runtime/protocol/fifo_ring.h"
#include "runtime/protocol/ll_call.h"
#include "runtime/protocol/ll_layout.h"

namespace llep::kernels {

/// How this rank reaches one peer.
struct HostPeer {
  uint8_t* direct_base = nullptr;                  ///< Peer's region mapped into this process, or null.
  const protocol::FifoRingHandle* fifo = nullptr;  ///< Proxy ring used when direct_base is null.
};

struct HostRankContext {
  protocol::LlLayout layout;
  int rank = 0;
  uint8_t* local_base = nullptr;    ///< This rank's LL region.
  const HostPeer* peers = nullptr;  ///< [num_ranks]
  /// Rank masking (DeepEP's shrink mode): [num_ranks], 1 = masked, or null (none). A masked rank is not sent to,
  /// contributes no tokens to a dispatch receive (its signal is not read) and no rows to a combine (its experts'
  /// top-k terms are dropped from the sum).
  const uint8_t* masked = nullptr;
};

// Each phase reads the call as the caller described it (runtime/protocol/ll_call.h) plus what the runtime adds.
struct DispatchSendArgs {
  const protocol::DispatchCall* call = nullptr;  ///< x and mode are read
  const RoutePlan* plan = nullptr;               ///< of call->topk_idx
  uint32_t seq = 0;                              ///< Call sequence number; picks the half.
};

/// Quantises each routed token once, builds the route blocks and delivers both to every destination.
/// Returns false only if a ring push was aborted (proxy failure); the caller reports the proxy's error.
bool DispatchSendHost(const HostRankContext& ctx, const DispatchSendArgs& a);

/// The messages one dispatch received, kept for its combine when the dispatch carried topk_weights: the combine
/// reduces each message's rows at this (expert) rank and returns one row per message (kernels/EXPERT_SIDE_COMBINE.md).
struct ExpertSidePlan {
  struct Message {
    int32_t token = 0;                     ///< the token's index on its home rank (the source)
    int32_t n = 0;                         ///< selections on this rank
    int64_t row[protocol::kMaxTopK] = {};  ///< local expert * (R*T) + row of recv_x, in the header's (top-k) order
    float w[protocol::kMaxTopK] = {};
  };
  uint64_t plan_key = 0;
  std::vector<std::vector<Message>> by_src;  ///< [R]: the source's messages, in slot order
};

struct DispatchRecvArgs {
  const protocol::DispatchCall* call = nullptr;  ///< mode and the outputs (recv_x ... statistics) are used
  uint32_t seq = 0;
  const uint32_t* tokens_from_src = nullptr;  ///< [R] value of each source's signal word.
  ExpertSidePlan* expert_plan = nullptr;      ///< filled when the call carries topk_weights
};

/// Unpacks all sources' messages (their signals must have been observed) into the packed layout:
/// blocks ordered by source, rows in source-token order, so the result is deterministic.
/// Returns an empty string on success, else a description of the inconsistent message.
std::string DispatchRecvHost(const HostRankContext& ctx, const DispatchRecvArgs& a);

struct CombineSendArgs {
  const protocol::CombineCall* call = nullptr;  ///< x (unless zero_copy: rows already in c_send of this half) and
                                                ///< layout_range (validated by the caller) are read
  uint32_t seq = 0;
  const ExpertSidePlan* expert_plan = nullptr;  ///< the handle's dispatch's, when call->expert_reduced
};

/// Returns each valid row to its home rank at the position route_plan.h defines; with call->expert_reduced, one
/// partial row per received message instead (ExpertSidePlan), at the token's position. False only if aborted.
bool CombineSendHost(const HostRankContext& ctx, const CombineSendArgs& a);

struct CombineRecvArgs {
  const protocol::CombineCall* call = nullptr;  ///< topk_weights and out are used
  const RoutePlan* plan = nullptr;              ///< of call->topk_idx
  uint32_t seq = 0;
};

/// out[t] = bf16(sum_k w[t][k] * row(t, k)) accumulated with fmaf in fp32 in top-k order, -1 slots skipped; with
/// call->expert_reduced, out[t] = bf16(sum_r part_r(t)) over the ranks r holding one of t's selections, ascending.
void CombineRecvHost(const HostRankContext& ctx, const CombineRecvArgs& a);

/// acc[c] = fmaf(bf16(row[c]), w, acc[c]) for c < n: one top-k term of the combine sum, correctly rounded.
void AccumulateWeightedRow(float* acc, const uint16_t* row, float w, int n);

/// Encodes one bf16 token into a dispatch payload (FP8 + scales, or BF16), vectorised where the CPU allows
/// (LLEP_CPU_PORTABLE_FP8=1 forces the scalar path). Bit-identical to EncodeDispatchPayloadReference.
void EncodeDispatchPayload(const uint16_t* x, int hidden, const protocol::DispatchMode& mode, uint8_t* payload);
/// The scalar reference: FloatToE4m3 per element (kernels/codec/fp8.h).
void EncodeDispatchPayloadReference(const uint16_t* x, int hidden, const protocol::DispatchMode& mode,
                                    uint8_t* payload);

}  // namespace llep::kernels
