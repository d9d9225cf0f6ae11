// The wave64 lane arithmetic of runtime/protocol/gpu_port.h, on the host: a 64-lane CDNA wavefront holds two 32-lane
// logical warps, and every collective the kernels use must act on the caller's half exactly as a CUDA warp would. An
// emulated wavefront (arrays of 64 lane values, ds_bpermute = read another lane's value, ballot = a 64-bit mask) runs
// the index functions and the step sequences the HIP helpers run (butterfly sum, shift-up scan, match-any peeling, the
// FIFO's warp-aggregated slot order) against a model of a 32-lane warp. No GPU needed; CI runs it.
#include "runtime/protocol/gpu_port.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <random>

namespace llep::gpu {
namespace {

constexpr int kWave = 64;
template <typename T>
using Lanes = std::array<T, kWave>;

uint64_t Ballot(const Lanes<bool>& p) {
  uint64_t b = 0;
  for (int l = 0; l < kWave; ++l) b |= uint64_t{p[l]} << l;
  return b;
}
template <typename T, typename Src>
Lanes<T> Bpermute(const Lanes<T>& v, Src src) {
  Lanes<T> out{};
  for (int l = 0; l < kWave; ++l) out[l] = v[src(l)];
  return out;
}
int Half(int l) { return l & 32; }

TEST(Wave64Test, BallotGivesTheCallersHalf) {
  std::mt19937 rng(1);
  for (int iter = 0; iter < 1000; ++iter) {
    Lanes<bool> p{};
    for (auto& x : p) x = rng() % 3 == 0;
    const uint64_t b = Ballot(p);
    for (int l = 0; l < kWave; ++l) {
      unsigned want = 0;  // a CUDA ballot over the 32 lanes of l's logical warp
      for (int i = 0; i < 32; ++i) want |= unsigned{p[Half(l) + i]} << i;
      ASSERT_EQ(wave64::HalfMask(b, l), want) << "lane " << l;
    }
  }
}

TEST(Wave64Test, ShuffleSourcesStayInTheHalfAndFollowCuda) {
  for (int l = 0; l < kWave; ++l) {
    const int lane = l & 31;
    for (int s = 0; s < 32; ++s) EXPECT_EQ(wave64::ShflSource(l, s), Half(l) + s);
    EXPECT_EQ(wave64::ShflSource(l, 37), Half(l) + 5);  // a source beyond 31 wraps, as __shfl_sync's does
    for (int d = 0; d <= 32; ++d) {                     // __shfl_up_sync: lanes below delta keep their own value
      EXPECT_EQ(wave64::ShflUpSource(l, d), lane >= d ? l - d : l) << l << " " << d;
      EXPECT_EQ(wave64::ShflUpSource(l, d) & 32, Half(l));
    }
    for (int m = 0; m < 32; ++m) {
      EXPECT_EQ(wave64::ShflXorSource(l, m), Half(l) + (lane ^ m));
    }
  }
}

// gpu::WarpSumT on HIP: v += WarpShflXor(v, o) for o = 16, 8, 4, 2, 1.
TEST(Wave64Test, ButterflySumIsPerHalf) {
  std::mt19937 rng(2);
  Lanes<unsigned> v{};
  for (auto& x : v) x = rng() % 1000;
  unsigned sum[2] = {0, 0};
  for (int l = 0; l < kWave; ++l) sum[l / 32] += v[l];
  for (int o = kWarpLanes / 2; o > 0; o >>= 1) {
    const Lanes<unsigned> y = Bpermute(v, [o](int l) { return wave64::ShflXorSource(l, o); });
    for (int l = 0; l < kWave; ++l) v[l] += y[l];
  }
  for (int l = 0; l < kWave; ++l) EXPECT_EQ(v[l], sum[l / 32]) << l;
}

// WarpInclusiveScan's step (ll_routing.cuh): y = WarpShflUp(x, o); if (lane >= o) x += y.
TEST(Wave64Test, ShiftUpScanIsPerHalf) {
  std::mt19937 rng(3);
  Lanes<int> x{}, in{};
  for (int l = 0; l < kWave; ++l) in[l] = x[l] = static_cast<int>(rng() % 50);
  for (int o = 1; o < 32; o <<= 1) {
    const Lanes<int> y = Bpermute(x, [o](int l) { return wave64::ShflUpSource(l, o); });
    for (int l = 0; l < kWave; ++l) x[l] += (l & 31) >= o ? y[l] : 0;
  }
  for (int l = 0; l < kWave; ++l) {
    int want = 0;
    for (int i = Half(l); i <= l; ++i) want += in[i];
    EXPECT_EQ(x[l], want) << l;
  }
}

// gpu::WarpMatchAny on HIP: the lowest unmatched lane broadcasts its value; the lanes holding it take the ballot.
TEST(Wave64Test, MatchAnyPeelingIsPerHalf) {
  std::mt19937 rng(4);
  for (int iter = 0; iter < 500; ++iter) {
    Lanes<int> v{};
    for (auto& x : v) x = static_cast<int>(rng() % (1 + iter % 9)) - 1;  // few distinct values, -1 included
    Lanes<unsigned> mine{};
    Lanes<unsigned> left{};
    Lanes<bool> all{};
    all.fill(true);
    const uint64_t active = Ballot(all);
    for (int l = 0; l < kWave; ++l) left[l] = wave64::HalfMask(active, l);
    for (int step = 0; step < 33; ++step) {  // lockstep: both halves loop until their own `left` is empty
      bool any = false;
      Lanes<int> lv{};
      for (int l = 0; l < kWave; ++l) {
        if (left[l] == 0) continue;
        any = true;
        lv[l] = v[wave64::ShflSource(l, __builtin_ffs(left[l]) - 1)];
      }
      if (!any) break;
      Lanes<bool> eq{};
      for (int l = 0; l < kWave; ++l) eq[l] = left[l] != 0 && v[l] == lv[l];
      const uint64_t b = Ballot(eq);
      for (int l = 0; l < kWave; ++l) {
        if (left[l] == 0) continue;
        const unsigned same = wave64::HalfMask(b, l);
        if (eq[l]) mine[l] = same;
        left[l] &= ~same;
      }
    }
    for (int l = 0; l < kWave; ++l) {
      unsigned want = 0;  // __match_any_sync over l's logical warp
      for (int i = 0; i < 32; ++i) want |= unsigned{v[Half(l) + i] == v[l]} << i;
      ASSERT_EQ(mine[l], want) << "iteration " << iter << " lane " << l;
    }
  }
}

// protocol::FifoPushWarp: mask = WarpBallot(active); the leader (lowest active lane) claims popc(mask) slots, and
// lane l takes base + popc(mask & ((1 << lane) - 1)). On a wavefront the two logical warps claim separately: each
// half's active lanes get slots 0..n-1 of its own claim, in lane order.
TEST(Wave64Test, WarpAggregatedPushOrderIsPerHalf) {
  std::mt19937 rng(5);
  for (int iter = 0; iter < 1000; ++iter) {
    Lanes<bool> active{};
    for (auto& x : active) x = rng() % 2 == 0;
    const uint64_t b = Ballot(active);
    for (int h = 0; h < 2; ++h) {
      int next = 0;
      for (int l = 32 * h; l < 32 * h + 32; ++l) {
        const unsigned mask = wave64::HalfMask(b, l);
        const int lane = l & 31;
        if (mask != 0) {
          EXPECT_TRUE(active[Half(l) + __builtin_ffs(mask) - 1]);  // the leader is an active lane of this half
        }
        if (!active[l]) continue;
        EXPECT_EQ(__builtin_popcount(mask & ((1u << lane) - 1u)), next++) << l;
        EXPECT_LE(next, __builtin_popcount(mask));
      }
    }
  }
}

}  // namespace
}  // namespace llep::gpu
