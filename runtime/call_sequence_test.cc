#include "runtime/call_sequence.h"

#include <gtest/gtest.h>

namespace llep {
namespace {

TEST(CallSequenceTest, AlternatesHalvesAndRefusesAThirdOperationInFlight) {
  CallSequence calls;
  EXPECT_EQ(calls.next(), 1u);
  const uint32_t a = *calls.Begin("dispatch");
  calls.AwaitReceive(a);
  const uint32_t b = *calls.Begin("dispatch");  // the other half: allowed while a is unreceived
  calls.AwaitReceive(b);
  EXPECT_NE(protocol::HalfOfSeq(a), protocol::HalfOfSeq(b));
  const auto refused = calls.Begin("combine");  // would reuse a's half
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("at most two"), absl::string_view::npos);
  EXPECT_EQ(calls.next(), b + 1) << "a refused send does not consume a sequence number";
  EXPECT_TRUE(calls.AwaitingReceive(a));
  EXPECT_TRUE(calls.Received(a));
  EXPECT_FALSE(calls.Received(a)) << "an operation is received once";
  EXPECT_FALSE(calls.AwaitingReceive(a));
  EXPECT_TRUE(calls.Begin("combine").ok());
  EXPECT_FALSE(calls.Received(0));
  EXPECT_FALSE(calls.Received(12345));
}

TEST(CallSequenceTest, OperationsThatCompleteInOneLaunchNeverBlock) {
  CallSequence calls;
  for (int i = 0; i < 1000; ++i) ASSERT_TRUE(calls.Begin("dispatch").ok());  // never awaiting a receive
  EXPECT_EQ(calls.next(), 1001u);
}

}  // namespace
}  // namespace llep
