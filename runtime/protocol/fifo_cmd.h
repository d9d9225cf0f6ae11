// The 16-byte command a producer (GPU warp or CPU backend thread) pushes to a proxy thread.
// Layer: runtime/protocol. Producer: fifo_ring.h FifoPush(). Consumer: proxy/fifo_consumer.cc.
//
// w0 carries addresses (or the signal word), w1 carries everything else and, in bit 63, the commit bit. The
// producer writes w0, then publishes w1 with a release store (or both in one 16-byte st.release.sys.v2.u64 on
// sm_90); the consumer acquire-loads w1, checks the commit bit, then reads w0. Offsets are relative to the
// sender's (local) and receiver's (remote) registered LL region, in 16-byte units: 32 bits reach 64 GiB.
//
//   kWrite : w0 = [63:32] remote_off/16, [31:0] local_off/16
//   kSignal: w0 = signal word (signal.h) to deliver to dst's inbox for (op, half, my rank)
//   w1     = [31:0] bytes, [47:32] dst rank, [51:48] opcode, [52] op, [53] half, [62:54] zero, [63] commit
#pragma once

#include <cstdint>

#include "runtime/protocol/hd.h"
#include "runtime/protocol/imm.h"

namespace llep::protocol {

inline constexpr uint32_t kFifoCmdVersion = 1;

enum class FifoOpcode : uint32_t { kNone = 0, kWrite = 1, kSignal = 2 };

inline constexpr int kCmdOffsetShift = 4;  // offsets are 16-byte aligned
inline constexpr uint64_t kCmdMaxOffset = (uint64_t{1} << (32 + kCmdOffsetShift)) - 1;
inline constexpr uint64_t kCmdMaxBytes = 0xFFFFFFFFull;
inline constexpr int kCmdDstShift = 32;
inline constexpr int kCmdOpcodeShift = 48;
inline constexpr int kCmdOpShift = 52;
inline constexpr int kCmdHalfShift = 53;
inline constexpr int kCmdCommitShift = 63;
inline constexpr uint64_t kCmdCommitBit = uint64_t{1} << kCmdCommitShift;
inline constexpr uint64_t kCmdReservedMask = ((uint64_t{1} << 9) - 1) << 54;

struct alignas(16) FifoCmd {
  uint64_t w0;
  uint64_t w1;
};
static_assert(sizeof(FifoCmd) == 16 && alignof(FifoCmd) == 16, "one 16-byte vector store must publish a whole command");

struct FifoCmdFields {
  FifoOpcode opcode;
  LlOp op;
  int half;
  int dst_rank;
  uint64_t bytes;
  uint64_t local_off;    // kWrite
  uint64_t remote_off;   // kWrite
  uint64_t signal_word;  // kSignal
};

/// True when a write command with these fields is representable (offsets aligned and in reach, size fits).
LLEP_HD constexpr bool WriteCmdFits(uint64_t local_off, uint64_t remote_off, uint64_t bytes) {
  return (local_off & 15) == 0 && (remote_off & 15) == 0 && local_off <= kCmdMaxOffset && remote_off <= kCmdMaxOffset &&
         bytes <= kCmdMaxBytes;
}

/// Builds a write command (commit bit clear; FifoPush sets it). Callers check WriteCmdFits first.
LLEP_HD constexpr FifoCmd MakeWriteCmd(LlOp op, int half, int dst_rank, uint64_t local_off, uint64_t remote_off,
                                       uint64_t bytes) {
  FifoCmd c{};
  c.w0 = JoinHalves(static_cast<uint32_t>(remote_off >> kCmdOffsetShift),
                    static_cast<uint32_t>(local_off >> kCmdOffsetShift));
  c.w1 = bytes | (uint64_t(dst_rank & 0xFFFF) << kCmdDstShift) |
         (uint64_t(static_cast<uint32_t>(FifoOpcode::kWrite)) << kCmdOpcodeShift) |
         (uint64_t(static_cast<uint32_t>(op)) << kCmdOpShift) | (uint64_t(half & 1) << kCmdHalfShift);
  return c;
}

/// Builds a signal command: "after my data writes for (op, half) to dst, deliver signal_word".
LLEP_HD constexpr FifoCmd MakeSignalCmd(LlOp op, int half, int dst_rank, uint64_t signal_word) {
  FifoCmd c{};
  c.w0 = signal_word;
  c.w1 = (uint64_t(dst_rank & 0xFFFF) << kCmdDstShift) |
         (uint64_t(static_cast<uint32_t>(FifoOpcode::kSignal)) << kCmdOpcodeShift) |
         (uint64_t(static_cast<uint32_t>(op)) << kCmdOpShift) | (uint64_t(half & 1) << kCmdHalfShift);
  return c;
}

/// Decodes a committed command; false for an unknown opcode or non-zero reserved bits.
LLEP_HD constexpr bool DecodeCmd(const FifoCmd& c, FifoCmdFields* f) {
  const uint32_t opcode = static_cast<uint32_t>((c.w1 >> kCmdOpcodeShift) & 0xF);
  if ((c.w1 & kCmdReservedMask) != 0) return false;
  if (opcode != static_cast<uint32_t>(FifoOpcode::kWrite) && opcode != static_cast<uint32_t>(FifoOpcode::kSignal)) {
    return false;
  }
  f->opcode = static_cast<FifoOpcode>(opcode);
  f->op = static_cast<LlOp>((c.w1 >> kCmdOpShift) & 1);
  f->half = static_cast<int>((c.w1 >> kCmdHalfShift) & 1);
  f->dst_rank = static_cast<int>((c.w1 >> kCmdDstShift) & 0xFFFF);
  f->bytes = c.w1 & 0xFFFFFFFFull;
  if (f->opcode == FifoOpcode::kWrite) {
    f->local_off = uint64_t{LowHalf(c.w0)} << kCmdOffsetShift;
    f->remote_off = uint64_t{HighHalf(c.w0)} << kCmdOffsetShift;
    f->signal_word = 0;
  } else {
    f->local_off = f->remote_off = 0;
    f->signal_word = c.w0;
  }
  return true;
}

}  // namespace llep::protocol
