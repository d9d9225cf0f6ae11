// The double-buffered low-latency region: every offset any rank, kernel or proxy uses is computed here.
// Layer: runtime/protocol. The host allocator sizes the region with ComputeLlLayout(); kernels and proxies get
// the resulting POD LlLayout by value and call its accessors; nothing re-derives an offset.
//
// One region per rank, two identical halves (call seq picks the half: signal.h HalfOfSeq). Per half, in order:
//   signals   [op][src]  uint64 signal words (signal.h)                       written by peers / own proxy
//   inbox     [op][src]  InboxSlot, remote-written by peers' proxies          read by own proxy
//   outbox    [op][dst]  InboxSlot staged by own proxy for its signal writes  read by the NIC
//   d_payload [T]        dispatch payload of each local token, staged once    read by NIC / local copies
//                        (slots of a call are packed at that call's mode stride, see DispatchPayloadStride)
//   d_route_s [dst]      route block for each destination (counts + headers)  read by NIC / local copies
//   d_route_r [src]      route block received from each source                 read by dispatch receive
//   d_recv    [src][T]   dispatch payloads received from each source           read by dispatch receive
//   c_send    [le][R*T]  combine rows; DeepEP's zero-copy buffer (get_next_low_latency_combine_buffer)
//   c_recv    [src][P]   combine rows received from each expert rank, P = T * min(kMaxTopK, E/R)
//   c_part    [dst][T]   an expert-side combine's partial rows staged for proxy destinations (EXPERT_SIDE_COMBINE.md)
// A route block is [E/R uint64 count words (PackRouteCount), padded to 16 B][T DispatchTokenHeader][T x kMaxTopK fp32
// weights, written only by a dispatch that carries them]. Each region starts
// on a kRegionAlign boundary. Size per half (PS = DispatchPayloadStrideMax, CS = CombineRowStride, RB = route block):
//   A(80R) + A(T*PS) + 2*A(R*RB) + A(R*T*PS) + A(E/R*R*T*CS) + A(R*P*CS) + A(R*T*CS),   A(x) = align_up(x, 256)
// and the whole region is twice that. For T=128, H=7168, E=256, R=4 it is 1.23 GB (DeepEP V1: 1.91 GB),
// because combine receives per (token, top-k slot) instead of per (token, global expert).
#pragma once

#include <cstdint>

#include "runtime/protocol/dispatch_msg.h"
#include "runtime/protocol/fast_div.h"
#include "runtime/protocol/hd.h"
#include "runtime/protocol/imm.h"
#include "runtime/protocol/ll_shape.h"
#include "runtime/protocol/signal.h"

namespace llep::protocol {

inline constexpr uint32_t kLlLayoutVersion = 1;
// Region alignment: covers 128-byte TMA/bulk-copy alignment and keeps regions on separate cache lines.
inline constexpr int64_t kRegionAlign = 256;

/// The handle's layout_range word for (local expert, source rank), DeepEP's format: the number of rows that source
/// sent the expert in the low 32 bits, the first of them (a row of the expert's [R*T] block) in the high 32 bits.
/// Dispatch receive writes it; combine send reads it. The only place the packing is spelled out.
LLEP_HD constexpr int64_t PackLayoutRange(int64_t count, int64_t begin) {
  return static_cast<int64_t>(JoinHalves(static_cast<uint32_t>(begin), static_cast<uint32_t>(count)));
}
LLEP_HD constexpr int64_t LayoutRangeCount(int64_t word) { return word & 0xFFFFFFFF; }
/// Signed, so a corrupt word shows as a negative begin that validation rejects.
LLEP_HD constexpr int64_t LayoutRangeBegin(int64_t word) { return word >> 32; }

/// Rows a home rank can receive from one expert rank in one combine: T tokens times the selections a token can
/// place on one rank (top-k, but never more than that rank's experts).
LLEP_HD constexpr int64_t CombineRowsPerSource(const LlShape& s) {
  const int64_t per_token = s.num_local_experts() < kMaxTopK ? s.num_local_experts() : kMaxTopK;
  return int64_t{s.max_tokens_per_rank} * per_token;
}

/// Bytes of the counts prefix of a route block.
LLEP_HD constexpr int64_t RouteCountsBytes(const LlShape& s) {
  return AlignUp(static_cast<int64_t>(sizeof(uint64_t)) * s.num_local_experts(), 16);  // PackRouteCount words
}
/// Bytes of a route block's weights section: kMaxTopK fp32 per message slot (kernels/EXPERT_SIDE_COMBINE.md).
LLEP_HD constexpr int64_t RouteWeightsRowBytes() { return int64_t{kMaxTopK} * 4; }
/// Bytes of a whole route block (counts + T headers + T weight rows).
LLEP_HD constexpr int64_t RouteBlockBytes(const LlShape& s) {
  return RouteCountsBytes(s) + int64_t{s.max_tokens_per_rank} * static_cast<int64_t>(sizeof(DispatchTokenHeader)) +
         int64_t{s.max_tokens_per_rank} * RouteWeightsRowBytes();
}
/// Bytes of a route block that carries `num_tokens` headers (what a sender actually writes).
LLEP_HD constexpr int64_t RouteBlockUsedBytes(const LlShape& s, int num_tokens) {
  return RouteCountsBytes(s) + int64_t{num_tokens} * static_cast<int64_t>(sizeof(DispatchTokenHeader));
}

/// Every offset of one rank's region, relative to the region base. A POD: pass it to kernels by value.
struct LlLayout {
  LlShape shape;
  int64_t payload_stride_max;  // DispatchPayloadStrideMax(H): bytes reserved per dispatch slot
  int64_t combine_stride;      // CombineRowStride(H)
  int64_t route_block_bytes;   // RouteBlockBytes(shape)
  int64_t route_counts_bytes;  // RouteCountsBytes(shape), kept so kernels do not divide E by R for it
  int64_t combine_rows_per_src;
  /// shape.num_local_experts() and shape.num_ranks as divisors: kernels split a global expert id into (rank, local
  /// expert) and a flattened index into its parts with these instead of an integer division (fast_div.h says why).
  FastDivisor local_experts, ranks;
  // Offsets inside a half.
  int64_t signals_off, inbox_off, outbox_off;
  int64_t d_payload_off, d_route_send_off, d_route_recv_off, d_recv_off;
  int64_t c_send_off, c_recv_off, c_part_off;
  int64_t half_bytes;   // one half, aligned
  int64_t total_bytes;  // both halves

  LLEP_HD constexpr int64_t HalfBase(int half) const { return half_bytes * half; }
  LLEP_HD constexpr int64_t SignalOffset(int half, LlOp op, int src) const {
    return HalfBase(half) + signals_off + (int64_t{static_cast<int>(op)} * shape.num_ranks + src) * 8;
  }
  LLEP_HD constexpr int64_t InboxOffset(int half, LlOp op, int src) const {
    return HalfBase(half) + inbox_off + (int64_t{static_cast<int>(op)} * shape.num_ranks + src) * 16;
  }
  LLEP_HD constexpr int64_t OutboxOffset(int half, LlOp op, int dst) const {
    return HalfBase(half) + outbox_off + (int64_t{static_cast<int>(op)} * shape.num_ranks + dst) * 16;
  }
  LLEP_HD constexpr int64_t DispatchPayloadOffset(int half, int token_idx, bool use_fp8) const {
    return HalfBase(half) + d_payload_off + int64_t{token_idx} * DispatchPayloadStride(shape.hidden, use_fp8);
  }
  LLEP_HD constexpr int64_t RouteSendOffset(int half, int dst) const {
    return HalfBase(half) + d_route_send_off + int64_t{dst} * route_block_bytes;
  }
  LLEP_HD constexpr int64_t RouteRecvOffset(int half, int src) const {
    return HalfBase(half) + d_route_recv_off + int64_t{src} * route_block_bytes;
  }
  /// Offset of header `slot` inside a route block that starts at `route_block_off`.
  LLEP_HD constexpr int64_t RouteHeaderOffset(int64_t route_block_off, int slot) const {
    return route_block_off + route_counts_bytes + int64_t{slot} * static_cast<int64_t>(sizeof(DispatchTokenHeader));
  }
  /// Offset of message `slot`'s weights row (its selections' weights, in header order) inside a route block that
  /// starts at `route_block_off`: after all T headers, so a block carrying n headers stays one contiguous prefix.
  LLEP_HD constexpr int64_t RouteWeightsOffset(int64_t route_block_off, int slot) const {
    return route_block_off + route_counts_bytes +
           int64_t{shape.max_tokens_per_rank} * static_cast<int64_t>(sizeof(DispatchTokenHeader)) +
           int64_t{slot} * RouteWeightsRowBytes();
  }
  /// Receive slots of one source are packed at the call's mode stride inside that source's T-slot area.
  LLEP_HD constexpr int64_t DispatchRecvOffset(int half, int src, int slot, bool use_fp8) const {
    return HalfBase(half) + d_recv_off + int64_t{src} * shape.max_tokens_per_rank * payload_stride_max +
           int64_t{slot} * DispatchPayloadStride(shape.hidden, use_fp8);
  }
  LLEP_HD constexpr int64_t CombineSendOffset(int half, int local_expert_idx, int64_t row) const {
    return HalfBase(half) + c_send_off + (int64_t{local_expert_idx} * shape.max_recv_rows() + row) * combine_stride;
  }
  LLEP_HD constexpr int64_t CombineRecvOffset(int half, int src, int64_t pos) const {
    return HalfBase(half) + c_recv_off + (int64_t{src} * combine_rows_per_src + pos) * combine_stride;
  }
  /// An expert-side combine's partial row for home rank `dst`'s token `t`, staged for the proxy.
  LLEP_HD constexpr int64_t CombinePartOffset(int half, int dst, int t) const {
    return HalfBase(half) + c_part_off + (int64_t{dst} * shape.max_tokens_per_rank + t) * combine_stride;
  }
};

/// The single definition of the layout. Call only with a validated shape (runtime/validate.h).
LLEP_HD constexpr LlLayout ComputeLlLayout(const LlShape& s) {
  LlLayout l{};
  l.shape = s;
  l.payload_stride_max = DispatchPayloadStrideMax(s.hidden);
  l.combine_stride = CombineRowStride(s.hidden);
  l.route_block_bytes = RouteBlockBytes(s);
  l.route_counts_bytes = RouteCountsBytes(s);
  l.combine_rows_per_src = CombineRowsPerSource(s);
  l.local_experts = FastDivisor::Make(static_cast<uint32_t>(s.num_local_experts()));
  l.ranks = FastDivisor::Make(static_cast<uint32_t>(s.num_ranks));
  const int64_t R = s.num_ranks, T = s.max_tokens_per_rank;
  int64_t off = 0;
  l.signals_off = off;
  off += AlignUp(int64_t{kNumLlOps} * R * 8, kRegionAlign);
  l.inbox_off = off;
  off += AlignUp(int64_t{kNumLlOps} * R * 16, kRegionAlign);
  l.outbox_off = off;
  off += AlignUp(int64_t{kNumLlOps} * R * 16, kRegionAlign);
  l.d_payload_off = off;
  off += AlignUp(T * l.payload_stride_max, kRegionAlign);
  l.d_route_send_off = off;
  off += AlignUp(R * l.route_block_bytes, kRegionAlign);
  l.d_route_recv_off = off;
  off += AlignUp(R * l.route_block_bytes, kRegionAlign);
  l.d_recv_off = off;
  off += AlignUp(R * T * l.payload_stride_max, kRegionAlign);
  l.c_send_off = off;
  off += AlignUp(int64_t{s.num_local_experts()} * s.max_recv_rows() * l.combine_stride, kRegionAlign);
  l.c_recv_off = off;
  off += AlignUp(R * l.combine_rows_per_src * l.combine_stride, kRegionAlign);
  l.c_part_off = off;
  off += AlignUp(R * T * l.combine_stride, kRegionAlign);
  l.half_bytes = off;
  l.total_bytes = int64_t{kNumHalves} * off;
  return l;
}

/// DeepEP V1's get_low_latency_rdma_size_hint (csrc/config.hpp at 567632d), kept only to report llep's size
/// next to it. It is not llep's layout.
LLEP_HD constexpr int64_t DeepEpV1LowLatencySizeHint(int T, int H, int E) {
  const int64_t dispatch_msg =
      16 + (2 * int64_t{H} > int64_t{H} + H / 128 * 4 ? 2 * int64_t{H} : int64_t{H} + H / 128 * 4);
  const int64_t combine_msg = int64_t{H} / 128 * 4 + 2 * int64_t{H};
  const int64_t send =
      T * dispatch_msg > int64_t{E} * T * combine_msg ? T * dispatch_msg : int64_t{E} * T * combine_msg;
  const int64_t recv = int64_t{E} * T * dispatch_msg > int64_t{E} * T * combine_msg ? int64_t{E} * T * dispatch_msg
                                                                                    : int64_t{E} * T * combine_msg;
  const int64_t signal = AlignUp(int64_t{4} * E, 128);
  const int64_t total = 2 * (send + recv + signal);
  return (total + 128) / 128 * 128;
}

}  // namespace llep::protocol
