#include "proxy/arrival_counter.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>

#include "runtime/protocol/signal.h"

namespace llep::proxy {
namespace {

using protocol::ImmKind;
using protocol::LlOp;
using protocol::PackImm;

class ArrivalCounterTest : public ::testing::Test {
 protected:
  ArrivalCounterTest()
      : layout_(protocol::ComputeLlLayout({4, 128, 8, 4})),
        region_(new uint8_t[layout_.total_bytes]()),
        counter_(layout_, region_.get()) {}

  void Inbox(LlOp op, int half, int src, uint64_t word, uint32_t writes) {
    protocol::InboxSlot slot{word, writes, protocol::kSignalVersion};
    std::memcpy(region_.get() + layout_.InboxOffset(half, op, src), &slot, sizeof(slot));
  }
  uint64_t Signal(LlOp op, int half, int src) const {
    return *reinterpret_cast<const uint64_t*>(region_.get() + layout_.SignalOffset(half, op, src));
  }

  protocol::LlLayout layout_;
  std::unique_ptr<uint8_t[]> region_;
  ArrivalCounter counter_;
};

TEST_F(ArrivalCounterTest, DataBeforeSignal) {
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(counter_.OnImmediate(PackImm(ImmKind::kData, LlOp::kDispatch, 1, 2)).ok());
  EXPECT_EQ(Signal(LlOp::kDispatch, 1, 2), 0u);
  Inbox(LlOp::kDispatch, 1, 2, protocol::PackSignal(7, 5), 3);
  ASSERT_TRUE(counter_.OnImmediate(PackImm(ImmKind::kSignal, LlOp::kDispatch, 1, 2)).ok());
  EXPECT_EQ(Signal(LlOp::kDispatch, 1, 2), protocol::PackSignal(7, 5));
  EXPECT_EQ(counter_.NumPending(), 0);
}

TEST_F(ArrivalCounterTest, SignalBeforeDataWaitsForTheLastWrite) {
  Inbox(LlOp::kCombine, 0, 3, protocol::PackSignal(8, 11), 2);
  ASSERT_TRUE(counter_.OnImmediate(PackImm(ImmKind::kSignal, LlOp::kCombine, 0, 3)).ok());
  EXPECT_EQ(counter_.NumPending(), 1);
  ASSERT_TRUE(counter_.OnImmediate(PackImm(ImmKind::kData, LlOp::kCombine, 0, 3)).ok());
  EXPECT_EQ(Signal(LlOp::kCombine, 0, 3), 0u);
  // A write for another key must not complete this one.
  ASSERT_TRUE(counter_.OnImmediate(PackImm(ImmKind::kData, LlOp::kCombine, 1, 3)).ok());
  EXPECT_EQ(Signal(LlOp::kCombine, 0, 3), 0u);
  ASSERT_TRUE(counter_.OnImmediate(PackImm(ImmKind::kData, LlOp::kCombine, 0, 3)).ok());
  EXPECT_EQ(Signal(LlOp::kCombine, 0, 3), protocol::PackSignal(8, 11));
  // The key is reset: the next call on it counts from zero again.
  Inbox(LlOp::kCombine, 0, 3, protocol::PackSignal(10, 0), 0);
  ASSERT_TRUE(counter_.OnImmediate(PackImm(ImmKind::kSignal, LlOp::kCombine, 0, 3)).ok());
  EXPECT_EQ(Signal(LlOp::kCombine, 0, 3), protocol::PackSignal(10, 0));
}

TEST_F(ArrivalCounterTest, ProtocolViolationsAreErrors) {
  EXPECT_EQ(counter_.OnImmediate(0).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(counter_.OnImmediate(PackImm(ImmKind::kData, LlOp::kDispatch, 0, 9)).code(), absl::StatusCode::kDataLoss);
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(counter_.OnImmediate(PackImm(ImmKind::kData, LlOp::kDispatch, 0, 1)).ok());
  Inbox(LlOp::kDispatch, 0, 1, protocol::PackSignal(3, 1), 1);
  EXPECT_EQ(counter_.OnImmediate(PackImm(ImmKind::kSignal, LlOp::kDispatch, 0, 1)).code(), absl::StatusCode::kInternal);
  protocol::InboxSlot bad{1, 0, 99};
  std::memcpy(region_.get() + layout_.InboxOffset(1, LlOp::kDispatch, 0), &bad, sizeof(bad));
  EXPECT_EQ(counter_.OnImmediate(PackImm(ImmKind::kSignal, LlOp::kDispatch, 1, 0)).code(), absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace llep::proxy
