// Exhaustive and randomized round trips of every wire field: immediates, FIFO commands, signal words and
// dispatch selections, plus rejection of everything a conforming sender never produces.
#include <gtest/gtest.h>

#include <random>

#include "runtime/protocol/dispatch_msg.h"
#include "runtime/protocol/fifo_cmd.h"
#include "runtime/protocol/imm.h"
#include "runtime/protocol/signal.h"

namespace llep::protocol {
namespace {

TEST(ImmTest, RoundTripsEveryField) {
  for (ImmKind kind : {ImmKind::kData, ImmKind::kSignal}) {
    for (LlOp op : {LlOp::kDispatch, LlOp::kCombine}) {
      for (int half = 0; half < 2; ++half) {
        for (int src = 0; src < kMaxRanks; ++src) {
          ImmFields f{};
          ASSERT_TRUE(UnpackImm(PackImm(kind, op, half, src), &f));
          ASSERT_EQ(f.kind, kind);
          ASSERT_EQ(f.op, op);
          ASSERT_EQ(f.half, half);
          ASSERT_EQ(f.src_rank, src);
        }
      }
    }
  }
}

TEST(ImmTest, RejectsWhatNoSenderProduces) {
  ImmFields f{};
  EXPECT_FALSE(UnpackImm(0, &f));                                                            // kind 0
  EXPECT_FALSE(UnpackImm(0xC0000000u | (kImmVersion << kImmVersionShift), &f));              // kind 3
  EXPECT_FALSE(UnpackImm(PackImm(ImmKind::kData, LlOp::kDispatch, 0, 5) ^ (1u << 24), &f));  // version
  EXPECT_FALSE(UnpackImm(PackImm(ImmKind::kData, LlOp::kDispatch, 0, 5) | (1u << 16), &f));  // reserved bit
}

TEST(FifoCmdTest, WriteRoundTripsRandomFields) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 200000; ++i) {
    const uint64_t lo = (rng() & (kCmdMaxOffset >> 4)) << 4, ro = (rng() & (kCmdMaxOffset >> 4)) << 4;
    const uint64_t bytes = rng() & kCmdMaxBytes;
    const int dst = static_cast<int>(rng() % kMaxRanks), half = static_cast<int>(rng() & 1);
    const LlOp op = (rng() & 1) ? LlOp::kCombine : LlOp::kDispatch;
    ASSERT_TRUE(WriteCmdFits(lo, ro, bytes));
    FifoCmd c = MakeWriteCmd(op, half, dst, lo, ro, bytes);
    c.w1 |= kCmdCommitBit;  // the commit bit must not disturb decoding
    FifoCmdFields f{};
    ASSERT_TRUE(DecodeCmd(c, &f));
    ASSERT_EQ(f.opcode, FifoOpcode::kWrite);
    ASSERT_EQ(f.local_off, lo);
    ASSERT_EQ(f.remote_off, ro);
    ASSERT_EQ(f.bytes, bytes);
    ASSERT_EQ(f.dst_rank, dst);
    ASSERT_EQ(f.half, half);
    ASSERT_EQ(f.op, op);
  }
}

TEST(FifoCmdTest, SignalCarriesTheWholeWord) {
  const uint64_t word = PackSignal(0xFFFFFFFFu, 0xDEADBEEFu);
  FifoCmdFields f{};
  ASSERT_TRUE(DecodeCmd(MakeSignalCmd(LlOp::kCombine, 1, 65535, word), &f));
  EXPECT_EQ(f.opcode, FifoOpcode::kSignal);
  EXPECT_EQ(f.signal_word, word);
  EXPECT_EQ(f.dst_rank, 65535);
  EXPECT_EQ(f.half, 1);
  EXPECT_EQ(f.op, LlOp::kCombine);
}

TEST(FifoCmdTest, LimitsAndMalformedCommands) {
  EXPECT_FALSE(WriteCmdFits(8, 0, 16));  // misaligned local offset
  EXPECT_FALSE(WriteCmdFits(0, 4, 16));  // misaligned remote offset
  EXPECT_FALSE(WriteCmdFits(kCmdMaxOffset + 1, 0, 16));
  EXPECT_FALSE(WriteCmdFits(0, 0, kCmdMaxBytes + 1));
  EXPECT_TRUE(WriteCmdFits(kCmdMaxOffset & ~uint64_t{15}, 0, kCmdMaxBytes));
  FifoCmdFields f{};
  EXPECT_FALSE(DecodeCmd(FifoCmd{0, 0}, &f));  // opcode none
  FifoCmd bad = MakeWriteCmd(LlOp::kDispatch, 0, 1, 0, 0, 16);
  bad.w1 |= uint64_t{1} << 54;  // reserved bit
  EXPECT_FALSE(DecodeCmd(bad, &f));
  bad = MakeWriteCmd(LlOp::kDispatch, 0, 1, 0, 0, 16);
  bad.w1 |= uint64_t{7} << kCmdOpcodeShift;  // unknown opcode
  EXPECT_FALSE(DecodeCmd(bad, &f));
}

TEST(SignalTest, PackUnpackAndOrdering) {
  EXPECT_EQ(SignalSeq(PackSignal(5, 9)), 5u);
  EXPECT_EQ(SignalValue(PackSignal(5, 9)), 9u);
  EXPECT_EQ(SignalSeq(0), 0u);  // zeroed memory = no call yet
  EXPECT_TRUE(SignalIsNewer(7, 5));
  EXPECT_FALSE(SignalIsNewer(3, 5));
  EXPECT_FALSE(SignalIsNewer(5, 5));
  EXPECT_TRUE(SignalIsNewer(1, 0xFFFFFFFFu));  // across wrap-around
  EXPECT_FALSE(SignalIsNewer(0xFFFFFFFFu, 1));
  EXPECT_EQ(HalfOfSeq(1), 1);
  EXPECT_EQ(HalfOfSeq(2), 0);
  EXPECT_EQ(NextCallSeq(0), 1u);
  EXPECT_EQ(NextCallSeq(41), 42u);
  // Wrap-around skips 0 ("never signalled") and still alternates halves.
  EXPECT_EQ(NextCallSeq(0xFFFFFFFFu), 2u);
  EXPECT_NE(HalfOfSeq(NextCallSeq(0xFFFFFFFFu)), HalfOfSeq(0xFFFFFFFFu));
}

TEST(DispatchMsgTest, SelectionsRoundTrip) {
  for (uint32_t le : {0u, 1u, 255u, 65535u}) {
    for (uint32_t row : {0u, 1u, 127u, 65535u}) {
      const uint32_t sel = PackSelection(le, row);
      EXPECT_EQ(SelectionExpert(sel), le);
      EXPECT_EQ(SelectionRow(sel), row);
    }
  }
  EXPECT_EQ(sizeof(DispatchTokenHeader), 80u);
}

TEST(DispatchMsgTest, RouteCountsCarryTheirCall) {
  for (uint32_t seq : {4u, 5u, 0xFFFFFFFFu}) {
    for (uint32_t n : {0u, 1u, 65535u, static_cast<uint32_t>(kMaxTokensPerRank)}) {
      const uint64_t w = PackRouteCount(seq, n);
      EXPECT_EQ(RouteCountSeq(w), seq);
      EXPECT_EQ(RouteCountValue(w), n);
    }
  }
  EXPECT_EQ(RouteCountSeq(0), 0u);  // zeroed memory is no call's count (sequence numbers are never 0)
  EXPECT_NE(RouteCountSeq(PackRouteCount(6, 3)), RouteCountSeq(PackRouteCount(4, 3)));  // the older call on a half
}

}  // namespace
}  // namespace llep::protocol
