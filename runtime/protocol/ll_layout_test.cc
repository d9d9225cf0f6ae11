// Pins the LL region layout: no two regions overlap, every accessor stays inside its region, alignment, the
// documented size formula, and llep's size next to DeepEP V1's hint for the DeepSeek shape.
#include "runtime/protocol/ll_layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace llep::protocol {
namespace {

struct Region {
  std::string name;
  int64_t begin, bytes;
};

std::vector<Region> Regions(const LlLayout& l) {
  const LlShape& s = l.shape;
  const int64_t R = s.num_ranks, T = s.max_tokens_per_rank;
  return {{"signals", l.signals_off, 2 * R * 8},
          {"inbox", l.inbox_off, 2 * R * 16},
          {"outbox", l.outbox_off, 2 * R * 16},
          {"d_payload", l.d_payload_off, T * l.payload_stride_max},
          {"d_route_send", l.d_route_send_off, R * l.route_block_bytes},
          {"d_route_recv", l.d_route_recv_off, R * l.route_block_bytes},
          {"d_recv", l.d_recv_off, R * T * l.payload_stride_max},
          {"c_send", l.c_send_off, s.num_local_experts() * s.max_recv_rows() * l.combine_stride},
          {"c_recv", l.c_recv_off, R * l.combine_rows_per_src * l.combine_stride},
          {"c_part", l.c_part_off, R * T * l.combine_stride}};
}

class LayoutTest : public ::testing::TestWithParam<LlShape> {};

TEST_P(LayoutTest, RegionsAreAlignedDisjointAndInsideTheHalf) {
  const LlLayout l = ComputeLlLayout(GetParam());
  std::vector<Region> regions = Regions(l);
  std::sort(regions.begin(), regions.end(), [](const Region& a, const Region& b) { return a.begin < b.begin; });
  for (size_t i = 0; i < regions.size(); ++i) {
    EXPECT_EQ(regions[i].begin % kRegionAlign, 0) << regions[i].name;
    EXPECT_GT(regions[i].bytes, 0) << regions[i].name;
    if (i + 1 < regions.size()) {
      EXPECT_LE(regions[i].begin + regions[i].bytes, regions[i + 1].begin) << regions[i].name << " overlaps";
    }
  }
  EXPECT_LE(regions.back().begin + regions.back().bytes, l.half_bytes);
  EXPECT_EQ(l.half_bytes % kRegionAlign, 0);
  EXPECT_EQ(l.total_bytes, 2 * l.half_bytes);
}

TEST_P(LayoutTest, SizeMatchesDocumentedFormula) {
  const LlShape s = GetParam();
  const LlLayout l = ComputeLlLayout(s);
  auto A = [](int64_t x) { return (x + 255) / 256 * 256; };
  const int64_t R = s.num_ranks, T = s.max_tokens_per_rank, H = s.hidden, E_loc = s.num_experts / s.num_ranks;
  const int64_t PS = std::max(AlignUp(H + H / 128 * 4, 16), 2 * H);
  const int64_t CS = AlignUp(2 * H + H / 128 * 4, 16);
  const int64_t RB = AlignUp(8 * E_loc, 16) + T * (16 + 4 * kMaxTopK) + T * 4 * kMaxTopK;  // counts, headers, weights
  const int64_t P = T * std::min<int64_t>(E_loc, kMaxTopK);
  const int64_t half =
      A(80 * R) + A(T * PS) + 2 * A(R * RB) + A(R * T * PS) + A(E_loc * R * T * CS) + A(R * P * CS) + A(R * T * CS);
  // The doc groups the three small signal areas as A(80R); they are aligned separately, so allow that slack.
  EXPECT_GE(l.half_bytes, half);
  EXPECT_LE(l.half_bytes, half + 2 * kRegionAlign);
  EXPECT_EQ(l.total_bytes, 2 * l.half_bytes);
}

TEST_P(LayoutTest, AccessorsStayInsideTheirRegion) {
  const LlShape s = GetParam();
  const LlLayout l = ComputeLlLayout(s);
  const int R = s.num_ranks, T = s.max_tokens_per_rank, E_loc = s.num_local_experts();
  for (int half = 0; half < 2; ++half) {
    const int64_t base = l.HalfBase(half);
    EXPECT_EQ(l.SignalOffset(half, LlOp::kCombine, R - 1) + 8, base + l.signals_off + 2 * R * 8);
    EXPECT_EQ(l.InboxOffset(half, LlOp::kCombine, R - 1) + 16, base + l.inbox_off + 2 * R * 16);
    EXPECT_EQ(l.OutboxOffset(half, LlOp::kCombine, R - 1) + 16, base + l.outbox_off + 2 * R * 16);
    for (bool fp8 : {false, true}) {
      const int64_t ps = DispatchPayloadStride(s.hidden, fp8);
      EXPECT_LE(l.DispatchPayloadOffset(half, T - 1, fp8) + ps, base + l.d_payload_off + T * l.payload_stride_max);
      // Source r's slots never reach into source r+1's.
      EXPECT_LE(l.DispatchRecvOffset(half, 0, T - 1, fp8) + ps,
                l.DispatchRecvOffset(half, 1 % R, 0, fp8) + (R == 1 ? T * l.payload_stride_max : 0));
      EXPECT_LE(l.DispatchRecvOffset(half, R - 1, T - 1, fp8) + ps,
                base + l.d_recv_off + int64_t{R} * T * l.payload_stride_max);
      EXPECT_EQ(l.DispatchPayloadOffset(half, 1, fp8) % 16, 0);
    }
    // Headers, then the weights rows, fill each block: the last source's last weights row ends the area.
    EXPECT_EQ(l.RouteHeaderOffset(l.RouteRecvOffset(half, R - 1), T - 1) + 80,
              l.RouteWeightsOffset(l.RouteRecvOffset(half, R - 1), 0));
    EXPECT_EQ(l.RouteWeightsOffset(l.RouteRecvOffset(half, R - 1), T - 1) + RouteWeightsRowBytes(),
              base + l.d_route_recv_off + R * l.route_block_bytes);
    EXPECT_EQ(l.RouteWeightsOffset(l.RouteSendOffset(half, 0), 1) % 16, 0);
    EXPECT_EQ(l.CombineSendOffset(half, E_loc - 1, s.max_recv_rows() - 1) + l.combine_stride,
              base + l.c_send_off + E_loc * s.max_recv_rows() * l.combine_stride);
    EXPECT_EQ(l.CombineRecvOffset(half, R - 1, l.combine_rows_per_src - 1) + l.combine_stride,
              base + l.c_recv_off + R * l.combine_rows_per_src * l.combine_stride);
    EXPECT_EQ(l.CombineRecvOffset(half, 0, 1) % 16, 0);
    EXPECT_EQ(l.CombinePartOffset(half, R - 1, T - 1) + l.combine_stride,
              base + l.c_part_off + int64_t{R} * T * l.combine_stride);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, LayoutTest,
                         ::testing::Values(LlShape{128, 7168, 256, 4}, LlShape{1, 2048, 64, 4}, LlShape{7, 2048, 32, 4},
                                           LlShape{256, 4096, 288, 8}, LlShape{4, 128, 2, 1}, LlShape{64, 384, 3, 3},
                                           LlShape{512, 7168, 256, 16}));

TEST(LayoutTest, DeepSeekShapeNextToDeepEp) {
  const LlShape s{128, 7168, 256, 4};
  const LlLayout l = ComputeLlLayout(s);
  const int64_t deepep = DeepEpV1LowLatencySizeHint(128, 7168, 256);
  EXPECT_EQ(deepep, 1908410496);  // DeepEP V1 get_low_latency_rdma_size_hint, shared/spec/deepep-ll-api.md §5
  EXPECT_EQ(DeepEpV1LowLatencySizeHint(128, 7168, 288), 2146961792);
  EXPECT_EQ(DeepEpV1LowLatencySizeHint(128, 2048, 64), 136315520);
  std::printf("llep LL buffer T=128 H=7168 E=256 R=4: %lld bytes (%.2f GB); DeepEP V1 hint: %lld bytes (%.2f GB)\n",
              static_cast<long long>(l.total_bytes), l.total_bytes / 1e9, static_cast<long long>(deepep), deepep / 1e9);
  EXPECT_LT(l.total_bytes, deepep * 2 / 3);
  // The zero-copy view keeps DeepEP's row stride: H + H/64 bf16 elements.
  EXPECT_EQ(l.combine_stride / 2, 7168 + 7168 / 64);
}

TEST(LayoutTest, PayloadSizes) {
  EXPECT_EQ(DispatchPayloadBytes(7168, true), 7168 + 56 * 4);
  EXPECT_EQ(DispatchPayloadBytes(7168, false), 14336);
  EXPECT_EQ(DispatchPayloadStride(7168, true), 7392);
  EXPECT_EQ(DispatchPayloadStride(128, true), 144);  // 132 padded to 16
  EXPECT_EQ(CombineRowStride(7168), 14560);
  EXPECT_EQ(CombineRowsPerSource(LlShape{128, 7168, 256, 4}), 128 * 16);
  EXPECT_EQ(CombineRowsPerSource(LlShape{128, 7168, 16, 4}), 128 * 4);
}

TEST(LayoutTest, LayoutRangeWordIsDeepEpsCountLowBeginHigh) {
  const int64_t w = PackLayoutRange(5, 1024);
  EXPECT_EQ(w, 5 + int64_t{1024} * 4294967296);  // count + begin * 2^32: the format DeepEP's handle carries
  EXPECT_EQ(LayoutRangeCount(w), 5);
  EXPECT_EQ(LayoutRangeBegin(w), 1024);
  const int64_t big = PackLayoutRange(0xFFFFFFFF, 0x7FFFFFFF);
  EXPECT_EQ(LayoutRangeCount(big), 0xFFFFFFFF);
  EXPECT_EQ(LayoutRangeBegin(big), 0x7FFFFFFF);
  EXPECT_LT(LayoutRangeBegin(int64_t{-1}), 0);  // a corrupt word reads as a negative begin, which callers reject
  static_assert(LayoutRangeCount(PackLayoutRange(7, 9)) == 7 && LayoutRangeBegin(PackLayoutRange(7, 9)) == 9);
}

// The kernels' divisions by the local expert and rank counts (fast_div.h) must equal `/` and `%` for every int32
// index >= 0. Every divisor up to 4096 (all E/R and R llep can meet in practice) against the edges of the range and
// random numerators; then large divisors, where the multiplier's rounding error is largest.
void ExpectDivides(uint32_t d, const std::vector<int>& numerators) {
  const FastDivisor f = FastDivisor::Make(d);
  for (const int n : numerators) {
    ASSERT_EQ(f.Div(n), n / static_cast<int>(d)) << n << " / " << d;
    ASSERT_EQ(f.Mod(n), n % static_cast<int>(d)) << n << " % " << d;
  }
}

TEST(FastDivisor, EqualsIntegerDivisionForEveryInt32Index) {
  std::mt19937 rng(12);
  std::uniform_int_distribution<int> any(0, INT32_MAX);
  for (uint32_t d = 1; d <= 4096; ++d) {
    std::vector<int> n = {0,
                          1,
                          static_cast<int>(d) - 1,
                          static_cast<int>(d),
                          static_cast<int>(d) + 1,
                          INT32_MAX,
                          INT32_MAX - 1,
                          INT32_MAX - static_cast<int>(d)};
    for (int k = 0; k < 64; ++k) n.push_back(any(rng));
    for (int q = 1; q < 1 << 16; q = q * 3 + 1) {  // around multiples of d, where an off-by-one would show
      const int64_t m = int64_t{q} * d;
      if (m < INT32_MAX) n.insert(n.end(), {static_cast<int>(m) - 1, static_cast<int>(m)});
    }
    ExpectDivides(d, n);
  }
  for (uint32_t d : {65535u, 65536u, 65537u, 1000003u, (1u << 30) - 1, 1u << 30, (1u << 30) + 1, 0x7FFFFFFFu}) {
    std::vector<int> n = {0, 1, INT32_MAX, INT32_MAX - 1};
    for (int k = 0; k < 4096; ++k) n.push_back(any(rng));
    ExpectDivides(d, n);
  }
}

TEST(FastDivisor, LayoutCarriesTheShapesDivisors) {
  const LlLayout l = ComputeLlLayout(LlShape{128, 7168, 288, 2});
  EXPECT_EQ(l.local_experts.divisor, 144u);
  EXPECT_EQ(l.ranks.divisor, 2u);
  EXPECT_EQ(l.local_experts.Div(287), 1);
  EXPECT_EQ(l.local_experts.Mod(287), 143);
}

}  // namespace
}  // namespace llep::protocol
