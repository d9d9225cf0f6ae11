#include "kernels/host/route_plan.h"

#include <gtest/gtest.h>

namespace llep::kernels {
namespace {

// 2 ranks x 2 local experts (E = 4), K = 2. Hand-computed plan.
TEST(RoutePlanTest, HandExample) {
  const protocol::LlShape shape{4, 256, 4, 2};
  const int64_t topk[] = {3,  0,    // t0: rank1/le1, rank0/le0
                          -1, 3,    // t1: rank1/le1
                          2,  3,    // t2: rank1/le0, rank1/le1
                          -1, -1};  // t3: nothing
  RoutePlan p;
  BuildRoutePlan(shape, topk, 4, 2, &p);
  EXPECT_EQ(p.counts, (std::vector<int32_t>{1, 0, 1, 3}));  // [dst][le]
  EXPECT_EQ(p.tokens_per_dst, (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(p.rows_per_dst, (std::vector<int32_t>{1, 4}));
  EXPECT_EQ(p.slot, (std::vector<int32_t>{0, 0, -1, 1, -1, 2, -1, -1}));  // [t][dst]
  // Row within block follows token order; pos adds the prefix of earlier local experts of that rank.
  EXPECT_EQ(p.at(0, 0).dst_rank, 1);
  EXPECT_EQ(p.at(0, 0).row_in_block, 0);
  EXPECT_EQ(p.at(0, 0).pos, 1 + 0);  // le1 comes after le0's 1 row
  EXPECT_EQ(p.at(1, 1).row_in_block, 1);
  EXPECT_EQ(p.at(1, 1).pos, 2);
  EXPECT_EQ(p.at(2, 0).local_expert, 0);
  EXPECT_EQ(p.at(2, 0).pos, 0);
  EXPECT_EQ(p.at(2, 1).pos, 3);
  EXPECT_EQ(p.at(0, 1).dst_rank, 0);
  EXPECT_EQ(p.at(0, 1).pos, 0);
  EXPECT_EQ(p.at(1, 0).dst_rank, -1);
  EXPECT_EQ(p.at(3, 0).dst_rank, -1);
  EXPECT_EQ(p.at(3, 1).dst_rank, -1);
}

}  // namespace
}  // namespace llep::kernels
