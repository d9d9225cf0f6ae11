#include "runtime/validate.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "runtime/protocol/ll_layout.h"

namespace llep {
namespace {

using protocol::DispatchMode;
using protocol::LlShape;
using ::testing::HasSubstr;

void ExpectInvalid(const absl::Status& s, const char* fragment) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(fragment));
}

TEST(ValidateTest, Shapes) {
  EXPECT_TRUE(ValidateShape({128, 7168, 256, 4}).ok());
  EXPECT_TRUE(ValidateShapeForGroup({128, 7168, 256, 4}, 4).ok());
  ExpectInvalid(ValidateShapeForGroup({128, 7168, 256, 4}, 2), "bootstrap has 2 ranks but the shape says 4");
  ExpectInvalid(ValidateShapeForGroup({128, 7000, 256, 4}, 4), "hidden");
  ExpectInvalid(ValidateShape({128, 7000, 256, 4}), "hidden must be a positive multiple of 128");
  ExpectInvalid(ValidateShape({128, 0, 256, 4}), "hidden");
  ExpectInvalid(ValidateShape({128, 7168, 250, 4}), "divisible by num_ranks");
  ExpectInvalid(ValidateShape({0, 7168, 256, 4}), "num_max_dispatch_tokens_per_rank");
  ExpectInvalid(ValidateShape({protocol::kMaxTokensPerRank + 1, 128, 4, 4}), "num_max_dispatch_tokens_per_rank");
  ExpectInvalid(ValidateShape({1, 2048, 6, 3}), "multiple of 4");
  ExpectInvalid(ValidateShape({4, 2048, 0, 4}), "num_experts");
  ExpectInvalid(ValidateShape({4, 2048, 4, 0}), "num_ranks");
  EXPECT_EQ(ValidateShape({65536, 65536, 65536, 64}).code(), absl::StatusCode::kResourceExhausted);
}

TEST(ValidateTest, Modes) {
  const LlShape s{8, 7168, 16, 4};
  EXPECT_TRUE(ValidateDispatchMode(s, {true, true, true}).ok());
  ExpectInvalid(ValidateDispatchMode(s, {true, false, true}), "use_ue8m0 requires round_scale");
  ExpectInvalid(ValidateDispatchMode(s, {false, true, false}), "round_scale requires use_fp8");
  ExpectInvalid(ValidateDispatchMode({8, 384, 16, 4}, {true, true, true}), "multiple of 512");
}

TEST(ValidateTest, CountsAndTopk) {
  const LlShape s{8, 128, 16, 4};
  EXPECT_TRUE(ValidateCounts(s, 0, 8).ok());
  ExpectInvalid(ValidateCounts(s, 9, 8), "num_tokens (9)");
  ExpectInvalid(ValidateCounts(s, -1, 8), "num_tokens");
  ExpectInvalid(ValidateCounts(s, 1, protocol::kMaxTopK + 1), "num_topk");
  ExpectInvalid(ValidateCounts(s, 1, 0), "num_topk");
  const int64_t ok[] = {0, 15, -1, 3};
  EXPECT_TRUE(ValidateTopk(s, ok, 2, 2).ok());
  const int64_t high[] = {0, 16};
  ExpectInvalid(ValidateTopk(s, high, 1, 2), "topk_idx[0][1] = 16 is out of range");
  const int64_t low[] = {-2, 1};
  ExpectInvalid(ValidateTopk(s, low, 1, 2), "out of range");
  const int64_t dup[] = {1, 2, 5, 5};
  ExpectInvalid(ValidateTopk(s, dup, 2, 2), "selects expert 5 twice");
  const int64_t holes[] = {-1, -1};
  EXPECT_TRUE(ValidateTopk(s, holes, 1, 2).ok());
  ExpectInvalid(ValidateTopk(s, nullptr, 1, 2), "null");
}

// combine_weights travel by their own flag: an empty batch carries them with no data, a batch with tokens must have it.
TEST(ValidateTest, DispatchCarryingWeights) {
  const LlShape s{8, 128, 16, 4};
  const uint16_t x[128] = {};
  const int64_t topk[2] = {0, 5};
  uint16_t recv_x[1];
  int32_t count[4], src_info[1];
  int64_t layout_range[16];
  protocol::DispatchCall c;
  c.x = x;
  c.topk_idx = topk;
  c.num_tokens = 1;
  c.num_topk = 2;
  c.mode = {false, false, false};
  c.recv_x = recv_x;
  c.recv_count = count;
  c.src_info = src_info;
  c.layout_range = layout_range;
  c.carries_weights = true;
  ExpectInvalid(ValidateDispatchCall(s, c, 1), "combine_weights has no data");
  c.num_tokens = 0;
  EXPECT_TRUE(ValidateDispatchCall(s, c, 1).ok());
}

TEST(ValidateTest, LayoutRange) {
  const LlShape s{4, 128, 8, 2};  // E_loc 4, rows 8
  std::vector<int64_t> lr(8, 0);
  lr[0] = protocol::PackLayoutRange(2, 0);
  lr[1] = protocol::PackLayoutRange(3, 2);
  EXPECT_TRUE(ValidateLayoutRange(s, lr.data()).ok());
  lr[1] = protocol::PackLayoutRange(3, 6);  // 6 + 3 > 8 rows
  ExpectInvalid(ValidateLayoutRange(s, lr.data()), "does not describe a block");
  lr[1] = 5;  // count over T
  ExpectInvalid(ValidateLayoutRange(s, lr.data()), "does not describe a block");
  lr[1] = -1;
  ExpectInvalid(ValidateLayoutRange(s, lr.data()), "does not describe a block");
  ExpectInvalid(ValidateLayoutRange(s, nullptr), "null");
}

}  // namespace
}  // namespace llep
