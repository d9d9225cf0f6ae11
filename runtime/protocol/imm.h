// The 32-bit immediate (remote CQ data) that accompanies every RDMA write the proxy posts.
// Layer: runtime/protocol. Producer: the sending proxy (proxy/proxy.cc). Consumer: the receiving proxy's
// completion loop, which counts data writes per (op, half, source) and releases a signal only when the
// announced number arrived (proxy/arrival_counter.h). 32 bits fit ibverbs imm_data and every libfabric
// provider's cq_data_size (8 bytes on all software providers; 4 on verbs).
//
// Layout: [31:30] kind, [29] op, [28] half, [27:24] version, [23:16] reserved (zero), [15:0] source rank.
// Kind 0 is never sent, so an all-zero immediate is always rejected.
#pragma once

#include <cstdint>

#include "runtime/protocol/hd.h"

namespace llep::protocol {

inline constexpr uint32_t kImmVersion = 1;

enum class ImmKind : uint32_t { kInvalid = 0, kData = 1, kSignal = 2 };
enum class LlOp : uint32_t { kDispatch = 0, kCombine = 1 };
inline constexpr int kNumLlOps = 2;
/// The operation's name in messages and metric labels.
LLEP_HD constexpr const char* LlOpName(LlOp op) { return op == LlOp::kDispatch ? "dispatch" : "combine"; }
inline constexpr int kNumHalves = 2;

inline constexpr int kImmSrcBits = 16;
inline constexpr int kImmReservedShift = 16;
inline constexpr int kImmVersionShift = 24;
inline constexpr int kImmHalfShift = 28;
inline constexpr int kImmOpShift = 29;
inline constexpr int kImmKindShift = 30;
inline constexpr uint32_t kImmSrcMask = (1u << kImmSrcBits) - 1;

struct ImmFields {
  ImmKind kind;
  LlOp op;
  int half;
  int src_rank;
};

/// Packs without checks; the caller guarantees src_rank < kMaxRanks and half in {0, 1} (validated shapes).
LLEP_HD constexpr uint32_t PackImm(ImmKind kind, LlOp op, int half, int src_rank) {
  return (static_cast<uint32_t>(kind) << kImmKindShift) | (static_cast<uint32_t>(op) << kImmOpShift) |
         (static_cast<uint32_t>(half & 1) << kImmHalfShift) | (kImmVersion << kImmVersionShift) |
         (static_cast<uint32_t>(src_rank) & kImmSrcMask);
}

/// Decodes `imm`; returns false for anything a conforming sender never produces (kind 0 or 3, another version,
/// non-zero reserved bits), so corrupt immediates become errors instead of miscounted arrivals.
LLEP_HD constexpr bool UnpackImm(uint32_t imm, ImmFields* out) {
  const uint32_t kind = imm >> kImmKindShift;
  const uint32_t version = (imm >> kImmVersionShift) & 0xFu;
  const uint32_t reserved = (imm >> kImmReservedShift) & 0xFFu;
  if (kind != static_cast<uint32_t>(ImmKind::kData) && kind != static_cast<uint32_t>(ImmKind::kSignal)) return false;
  if (version != kImmVersion || reserved != 0) return false;
  out->kind = static_cast<ImmKind>(kind);
  out->op = static_cast<LlOp>((imm >> kImmOpShift) & 1u);
  out->half = static_cast<int>((imm >> kImmHalfShift) & 1u);
  out->src_rank = static_cast<int>(imm & kImmSrcMask);
  return true;
}

}  // namespace llep::protocol
