#include "runtime/call_sequence.h"

#include <gtest/gtest.h>

namespace llep {
namespace {

using protocol::LlOp;

TEST(CallSequenceTest, AlternatesHalvesAndRefusesAThirdOperationInFlight) {
  CallSequence calls;
  EXPECT_EQ(calls.next(), 1u);
  const uint32_t a = *calls.Begin(LlOp::kDispatch);
  calls.AwaitReceive(a);
  const uint32_t b = *calls.Begin(LlOp::kDispatch);  // the other half: allowed while a is unreceived
  calls.AwaitReceive(b);
  EXPECT_NE(protocol::HalfOfSeq(a), protocol::HalfOfSeq(b));
  const auto refused = calls.Begin(LlOp::kCombine);  // would reuse a's half
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("at most two"), absl::string_view::npos);
  EXPECT_EQ(calls.next(), b + 1) << "a refused send does not consume a sequence number";
  EXPECT_TRUE(calls.AwaitingReceive(a));
  EXPECT_TRUE(calls.Received(a));
  EXPECT_FALSE(calls.Received(a)) << "an operation is received once";
  EXPECT_FALSE(calls.AwaitingReceive(a));
  EXPECT_TRUE(calls.Begin(LlOp::kCombine).ok()) << "a's half, but the combine region: nobody reads it";
  EXPECT_FALSE(calls.Received(0));
  EXPECT_FALSE(calls.Received(12345));
}

TEST(CallSequenceTest, OperationsThatCompleteInOneLaunchNeverBlock) {
  CallSequence calls;
  for (int i = 0; i < 1000; ++i) {
    const auto seq = calls.Begin(i % 3 == 0 ? LlOp::kCombine : LlOp::kDispatch);
    ASSERT_TRUE(seq.ok()) << seq.status();
    calls.Completed(*seq);
  }
  EXPECT_EQ(calls.next(), 1001u);
}

// Two dispatches in flight, both received, then a third dispatch into the first one's region: peers may still be
// reading that region (their receive of it is not ordered before anything this rank received), so it is refused
// until this rank sent and received another operation.
TEST(CallSequenceTest, RefusesToReuseARegionPeersMayStillRead) {
  for (bool reversed : {false, true}) {
    CallSequence calls;
    const uint32_t a = *calls.Begin(LlOp::kDispatch);
    calls.AwaitReceive(a);
    const uint32_t b = *calls.Begin(LlOp::kDispatch);
    calls.AwaitReceive(b);
    ASSERT_TRUE(calls.Received(reversed ? b : a));
    ASSERT_TRUE(calls.Received(reversed ? a : b));
    const auto refused = calls.Begin(LlOp::kDispatch);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(refused.status().message().find("before they are known to have received it"), absl::string_view::npos)
        << refused.status();
    // A combine (another region) is fine, and once it was received the dispatch region may be reused.
    const uint32_t c = *calls.Begin(LlOp::kCombine);
    calls.AwaitReceive(c);
    EXPECT_FALSE(calls.Begin(LlOp::kDispatch).ok()) << "c was sent, not yet received";
    ASSERT_TRUE(calls.Received(c));
    EXPECT_TRUE(calls.Begin(LlOp::kDispatch).ok());
  }
}

// The decode-loop patterns engines use pass both rules for many layers: hooks in issue order with other work between
// (one micro-batch), and two overlapped micro-batches (dispatch A, dispatch B, hooks, combine A, combine B, hooks).
TEST(CallSequenceTest, DecodeLoopPatternsAreAllowed) {
  CallSequence calls;
  auto send = [&](LlOp op) {
    const auto seq = calls.Begin(op);
    EXPECT_TRUE(seq.ok()) << seq.status();
    calls.AwaitReceive(*seq);
    return *seq;
  };
  for (int layer = 0; layer < 100; ++layer) {
    const uint32_t d = send(LlOp::kDispatch);
    ASSERT_TRUE(calls.Received(d));
    const uint32_t c = send(LlOp::kCombine);
    ASSERT_TRUE(calls.Received(c));
  }
  for (int layer = 0; layer < 100; ++layer) {
    const uint32_t da = send(LlOp::kDispatch), db = send(LlOp::kDispatch);
    ASSERT_TRUE(calls.Received(da));
    ASSERT_TRUE(calls.Received(db));
    const uint32_t ca = send(LlOp::kCombine), cb = send(LlOp::kCombine);
    ASSERT_TRUE(calls.Received(layer % 2 ? cb : ca));  // either order of the combine hooks
    ASSERT_TRUE(calls.Received(layer % 2 ? ca : cb));
  }
}

}  // namespace
}  // namespace llep
