// Every device error code maps to the status code the protocol assigns it, names what the caller needs (the rank,
// the id, the seq) and tells recoverable from fatal the way the kernels do.
#include "runtime/device_error_status.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace llep {
namespace {

using protocol::DeviceErrorRecord;
using ::testing::HasSubstr;

DeviceErrorContext Ctx() { return {/*rank=*/1, /*num_experts=*/64, absl::Seconds(3), "UNAVAILABLE: link down"}; }

TEST(DeviceErrorStatusTest, EveryCodeGetsItsCanonicalCodeAndANonEmptyMessage) {
  for (uint32_t code = 1; code < protocol::kNumDeviceErrorCodes + 2; ++code) {
    const absl::Status s = DeviceErrorToStatus({code, 1, 2, 7, 42}, Ctx());
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(static_cast<int>(s.code()), static_cast<int>(protocol::DeviceErrorCanonicalCode(code))) << code;
    EXPECT_THAT(std::string(s.message()), HasSubstr("combine")) << code;
  }
  EXPECT_FALSE(DeviceErrorToStatus({protocol::kDeviceOk, 0, 0, 0, 0}, Ctx()).ok());  // only a corrupt record
}

TEST(DeviceErrorStatusTest, MessagesNameWhatTheCallerMustFix) {
  absl::Status s = DeviceErrorToStatus({protocol::kDeviceBadExpertId, 0, -1, 5, 99}, Ctx());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("GPU dispatch call 5: topk_idx holds expert id 99, outside [-1, 64)"));
  s = DeviceErrorToStatus({protocol::kDeviceTimeout, 1, 3, 9, 0}, Ctx());
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank 3 did not signal within 3s"));
  s = DeviceErrorToStatus({protocol::kDeviceTimeout, 1, 1, 9, -1}, Ctx());  // own rank
  EXPECT_THAT(std::string(s.message()), HasSubstr("this rank's own kernel did not finish its sends"));
  s = DeviceErrorToStatus({protocol::kDeviceProxyFailed, 0, 2, 4, 0}, Ctx());
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(s.message()), HasSubstr("the proxy serving rank 2 stopped: UNAVAILABLE: link down"));
  s = DeviceErrorToStatus({protocol::kDeviceInFlight, 0, -1, 6, 4}, Ctx());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("still held call 4"));
  s = DeviceErrorToStatus({protocol::kDeviceSequenceOverrun, 0, 2, 6, 8}, Ctx());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank 2 already signalled call 8"));
  s = DeviceErrorToStatus({77, 0, 2, 6, 8}, Ctx());
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr("error code 77"));
}

TEST(DeviceErrorStatusTest, CombineMismatchNamesBothCounts) {
  const absl::Status s =
      DeviceErrorToStatus({protocol::kDeviceCombineMismatch, 1, 3, 7, (int64_t{8} << 32) | 5}, Ctx());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank 3 returned 8 rows but this rank's topk_idx selects 5"));
}

TEST(DeviceErrorStatusTest, ExpertSideCombineCausesAreNamed) {
  absl::Status s = DeviceErrorToStatus({protocol::kDeviceCombineMismatch, 1, 2, 9, protocol::kCombinePlanGone}, Ctx());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("rank 2 no longer holds the plan of this combine's dispatch"));
  s = DeviceErrorToStatus({protocol::kDeviceCombineMismatch, 1, 0, 9, protocol::kCombineWeightsDiffer}, Ctx());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("topk_weights differ from the combine_weights its dispatch carried"));
}

TEST(DeviceErrorStatusTest, OnlyTheCallersBadInputIsRecoverable) {
  for (uint32_t code = 1; code < protocol::kNumDeviceErrorCodes; ++code) {
    const bool recoverable = code == protocol::kDeviceBadExpertId || code == protocol::kDeviceBadLayoutRange ||
                             code == protocol::kDeviceCombineMismatch;
    EXPECT_EQ(protocol::DeviceErrorIsRecoverable(code), recoverable) << code;
    // Recoverable errors are the caller's bad input; fatal ones never are.
    EXPECT_EQ(protocol::DeviceErrorCanonicalCode(code) == protocol::CanonicalCode::kInvalidArgument, recoverable);
  }
}

}  // namespace
}  // namespace llep
