// Dispatch and combine message formats: the token header, its selection entries and the payload sizes.
// Layer: runtime/protocol. Producer: the dispatch send phase (CPU backend, CUDA kernel). Consumer: the dispatch
// receive phase on the destination rank. Messages are plain data; visibility is ordered by signal.h words.
//
// One dispatch message travels per (token, destination rank), not per (token, expert): a token that selects
// three experts on one rank crosses the wire once and the receiver fans it out to three packed rows. The header
// therefore lists the selections for that destination, each with its row inside the (local expert, source)
// block, so the receiver can place rows in parallel without a scan.
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime/protocol/hd.h"
#include "runtime/protocol/ll_shape.h"
#include "runtime/protocol/signal.h"

namespace llep::protocol {

inline constexpr uint32_t kDispatchMsgVersion = 1;

// A selection entry: [31:16] local expert index, [15:0] row within the (local expert, source rank) block.
inline constexpr int kSelRowBits = 16;
inline constexpr uint32_t kSelRowMask = (1u << kSelRowBits) - 1;
inline constexpr int kSelExpertBits = 16;

LLEP_HD constexpr uint32_t PackSelection(uint32_t local_expert_idx, uint32_t row_in_block) {
  return (local_expert_idx << kSelRowBits) | (row_in_block & kSelRowMask);
}
LLEP_HD constexpr uint32_t SelectionExpert(uint32_t sel) { return sel >> kSelRowBits; }
LLEP_HD constexpr uint32_t SelectionRow(uint32_t sel) { return sel & kSelRowMask; }

inline constexpr uint32_t kMsgFlagFp8 = 1u << 0;
/// The message's weights row (ll_layout.h RouteWeightsOffset) holds its selections' weights: the dispatch carried
/// topk_weights, so its combine reduces at the expert side (kernels/EXPERT_SIDE_COMBINE.md).
inline constexpr uint32_t kMsgFlagWeights = 1u << 1;

/// A route block starts with one count word per local expert: how many of the source's selections go to it, tagged
/// with the call's sequence number exactly as a signal word is ([63:32] seq, [31:0] count; signal.h). The tag lets a
/// receiver read the counts before (or while) it waits for the source's signal, without an acquire, and know whether
/// what it read is this call's: a receive-only launch loads them with the signal words instead of one round trip after
/// them. A word whose tag is not the call's after the signal was seen is a protocol error (a stale or overwritten
/// block), which an untagged count could not reveal.
LLEP_HD constexpr uint64_t PackRouteCount(uint32_t seq, uint32_t count) { return PackSignal(seq, count); }
LLEP_HD constexpr uint32_t RouteCountSeq(uint64_t word) { return SignalSeq(word); }
LLEP_HD constexpr uint32_t RouteCountValue(uint64_t word) { return SignalValue(word); }

/// Per (token, destination rank) header. Lives in the destination's route block (ll_layout.h), not next to the
/// payload, so one token's payload staged once can be written to several ranks unchanged.
struct alignas(16) DispatchTokenHeader {
  int32_t src_token_idx;   ///< Token index on the source rank (becomes src_info on the receiver).
  uint16_t num_sel;        ///< Valid entries in sel[], 1..kMaxTopK.
  uint16_t version;        ///< kDispatchMsgVersion; lets a receiver reject garbage instead of fanning it out.
  uint32_t seq;            ///< Call sequence number (signal.h); a mismatch means the slot was overwritten.
  uint32_t flags;          ///< kMsgFlagFp8 when the payload is FP8; the receiver checks it matches its own call.
  uint32_t sel[kMaxTopK];  ///< PackSelection(local_expert, row_in_block), in top-k order.
};
static_assert(sizeof(DispatchTokenHeader) == 16 + 4 * kMaxTopK, "header size is part of the route-block layout");
static_assert(sizeof(DispatchTokenHeader) % 16 == 0, "headers are copied with 16-byte vector stores");
static_assert(offsetof(DispatchTokenHeader, sel) == 16, "selections start after the fixed 16-byte prefix");

LLEP_HD constexpr int64_t AlignUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

/// Bytes of an FP8 payload: H e4m3 bytes followed by H/128 fp32 scale_inv values.
LLEP_HD constexpr int64_t Fp8PayloadBytes(int hidden) {
  return int64_t{hidden} + int64_t{hidden / kChannelsPerScale} * 4;
}
/// Bytes of a BF16 payload.
LLEP_HD constexpr int64_t Bf16PayloadBytes(int hidden) { return int64_t{hidden} * 2; }
/// Bytes one dispatch payload of the given mode occupies on the wire.
LLEP_HD constexpr int64_t DispatchPayloadBytes(int hidden, bool use_fp8) {
  return use_fp8 ? Fp8PayloadBytes(hidden) : Bf16PayloadBytes(hidden);
}
/// Stride of dispatch payload slots in a call of the given mode: the payload, 16-byte aligned for vector copies.
/// Slots are packed at the mode's own stride so a run of consecutive slots is one contiguous write with no
/// padding on the wire (zero padding whenever H % 512 == 0).
LLEP_HD constexpr int64_t DispatchPayloadStride(int hidden, bool use_fp8) {
  return AlignUp(DispatchPayloadBytes(hidden, use_fp8), 16);
}
/// The larger of the two strides: what the layout reserves per slot.
LLEP_HD constexpr int64_t DispatchPayloadStrideMax(int hidden) {
  return DispatchPayloadStride(hidden, false) > DispatchPayloadStride(hidden, true)
             ? DispatchPayloadStride(hidden, false)
             : DispatchPayloadStride(hidden, true);
}
/// Offset of the fp32 scales inside an FP8 payload.
LLEP_HD constexpr int64_t Fp8ScalesOffset(int hidden) { return hidden; }

/// Stride of one combine row, in bytes: BF16 data plus H/128 * 4 bytes reserved for LogFMT metadata, 16-byte
/// aligned. Equals DeepEP's zero-copy row stride (H + H/64 bf16 elements) whenever H % 512 == 0, so
/// get_next_low_latency_combine_buffer() views keep DeepEP's strides.
LLEP_HD constexpr int64_t CombineRowStride(int hidden) {
  return AlignUp(Bf16PayloadBytes(hidden) + int64_t{hidden / kChannelsPerScale} * 4, 16);
}
/// Bytes of combine data actually sent per row (BF16 wire format).
LLEP_HD constexpr int64_t CombineRowBytes(int hidden) { return Bf16PayloadBytes(hidden); }

}  // namespace llep::protocol
