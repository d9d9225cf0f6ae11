// The kernels' work splits and bit helpers (ll_kernels.h): CombineRecvSplit, the host-made split the combine receive
// divides with, ReceiveOnlyCtas, the grid of a hook's receive, SplitLog2, the closed form the dispatch receive and the
// expert-side combine send split messages with, and NthSetBit16, which the dispatch send's header gathers with.
// Host-only: it runs wherever this binary builds, device or not.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "kernels/cuda/ll_kernels.h"

namespace llep::kernels::cuda {
namespace {

// Every CTA's share equals the split written with plain divisions (the receive's arithmetic before the split came
// from the host), and every (token, chunk) of a call is reduced by exactly one CTA's warp item.
TEST(CombineRecvSplit, EqualsPlainDivisionAndCoversEveryChunkOnce) {
  constexpr int kWarpsPerCta = 16;  // the receive's work items per token and round are dealt over 16 warps
  for (int hidden : {128, 2048, 4096, 5120, 7168, 8192}) {
    for (int G : {1, 2, 3, 5, 16, 20, 24, 32, 33, 64, 78, 132}) {
      for (int T : {0, 1, 2, 3, 7, 8, 16, 31, 32, 64, 128, 129, 256}) {
        const CombineRecvSplit sp = PlanCombineRecvSplit(hidden, T, G);
        const int chunks = (hidden + 255) / 256;
        const int segs = std::max(1, std::min((chunks + kWarpsPerCta - 1) / kWarpsPerCta, G / std::max(T, 1)));
        const int G_tok = G / segs;
        ASSERT_EQ(sp.num_ctas, G);
        ASSERT_EQ(sp.chunks, chunks);
        ASSERT_EQ(static_cast<int>(sp.segs.divisor), segs);
        ASSERT_EQ(static_cast<int>(sp.token_ctas.divisor), G_tok);
        int reduced = 0;
        for (int b = 0; b < G; ++b) {
          const CombineRecvSplit::Cta c = sp.ForCta(b, T);
          const int seg = b / G_tok, slot = b % G_tok;
          const int ch_lo = seg * chunks / segs, ch_count = (seg + 1) * chunks / segs - ch_lo;
          const int mine = seg < segs && T > slot ? (T - slot + G_tok - 1) / G_tok : 0;
          ASSERT_EQ(c.seg, seg) << "H=" << hidden << " G=" << G << " T=" << T << " b=" << b;
          ASSERT_EQ(c.slot, slot);
          ASSERT_EQ(c.num_tokens, mine);
          if (mine == 0) continue;
          ASSERT_EQ(c.ch_lo, ch_lo);
          ASSERT_EQ(c.ch_count, ch_count);
          ASSERT_EQ(static_cast<int>(c.per_token.divisor), ch_count);
          for (int item = 0; item < std::min(mine, kWarpsPerCta) * ch_count; ++item) {
            ASSERT_EQ(c.per_token.Div(item), item / ch_count);
          }
          reduced += mine * ch_count;
        }
        ASSERT_EQ(reduced, T * chunks) << "H=" << hidden << " G=" << G << " T=" << T;
      }
    }
  }
}

// After a send phase the CTAs take the tokens in another order (AfterSend): still every index once, so every
// (token, chunk) once; where the send's CTAs, the tokens' and the publishers fit side by side, the tokens on the CTAs
// just below the publishers (CTAs G-2-d), a token's segments side by side, away from CTAs 0, 1, ..., which the send
// gives its rows to; elsewhere the plain order.
TEST(CombineRecvSplit, AfterSendIsABijectionWithTheTokensBelowThePublishers) {
  for (int hidden : {128, 4096, 7168}) {
    for (int G : {1, 2, 3, 5, 16, 33, 64, 78, 132}) {
      for (int R : {1, 2, 4, 8, 64, 200}) {
        for (int T : {0, 1, 2, 4, 8, 16, 32, 128}) {
          for (int k : {1, 8}) {
            const CombineRecvSplit sp = PlanCombineRecvSplit(hidden, T, G);
            std::vector<int> seen(G, 0);
            for (int b = 0; b < G; ++b) {
              const int l = sp.AfterSend(b, R, T, k);
              ASSERT_GE(l, 0) << "H=" << hidden << " G=" << G << " R=" << R << " T=" << T << " b=" << b;
              ASSERT_LT(l, G);
              ++seen[l];
            }
            ASSERT_EQ(std::count(seen.begin(), seen.end(), 1), G) << "H=" << hidden << " G=" << G << " R=" << R;
          }
        }
      }
    }
  }
  // H = 7168, 132 CTAs, top-8. T = 1: 8 rows in 32 pieces on CTAs 0-31; the token's two segments on CTAs 129 and 128
  // (one rank) or 128 and 127 (two). T = 8: 64 rows on CTAs 0-63, the 16 segments on CTAs 114-129 (one rank).
  const auto token_ctas = [](int T, int R) {
    const CombineRecvSplit sp = PlanCombineRecvSplit(7168, T, 132);
    std::vector<int> ctas;
    for (int b = 0; b < 132; ++b) {
      if (sp.ForCta(sp.AfterSend(b, R, T, 8), T).num_tokens > 0) ctas.push_back(b);
    }
    return ctas;
  };
  for (int R : {1, 2}) ASSERT_EQ(token_ctas(1, R), (std::vector<int>{129 - R, 130 - R})) << "R=" << R;
  std::vector<int> t8;
  for (int b = 114; b < 130; ++b) t8.push_back(b);
  ASSERT_EQ(token_ctas(8, 1), t8);
  // Where they do not fit, the plain order: T = 4 (32 rows in 128 pieces), T = 16 (128 rows), 32, 128.
  for (int T : {4, 16, 32, 128}) {
    const CombineRecvSplit sp = PlanCombineRecvSplit(7168, T, 132);
    for (int b = 0; b < 132; ++b) ASSERT_EQ(sp.AfterSend(b, 2, T, 8), b) << "T=" << T << " b=" << b;
  }
}

// FloorLog2 / CeilLog2 equal plain counts of halvings / doublings, and SplitLog2 equals the loop it replaced
// (lg from lo, doubled while 2 << lg stays within the pieces and total << (lg + 1) within the budget) for every total,
// budget, pieces and lo in ranges beyond what a launch meets: totals up to 2048 messages, budgets of CTAs and of CTAs x
// 16 warps, up to 64 pieces (a 128 KiB payload's 256 slices are never split further than that).
TEST(SplitLog2, EqualsTheDoublingLoop) {
  for (uint32_t x = 1; x < (1u << 20); x = x * 3 / 2 + 1) {
    int halvings = 0, doublings = 0;
    for (uint32_t y = x; y > 1; y >>= 1) ++halvings;
    while ((uint64_t{1} << doublings) < x) ++doublings;
    ASSERT_EQ(FloorLog2(x), halvings) << x;
    ASSERT_EQ(CeilLog2(x), doublings) << x;
  }
  ASSERT_EQ(FloorLog2(0xFFFFFFFFu), 31);
  ASSERT_EQ(CeilLog2(0x80000000u), 31);
  for (int total = 0; total <= 2048; total += total < 64 ? 1 : 37) {
    for (int budget : {1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 63, 64, 100, 128, 130, 131, 132, 256, 2080, 2112, 4096}) {
      for (int pieces = 1; pieces <= 64; ++pieces) {
        for (int lo = 0; lo <= 4; ++lo) {
          int lg = lo;
          while ((2 << lg) <= pieces && (total << (lg + 1)) <= budget) ++lg;
          ASSERT_EQ(SplitLog2(total, budget, lo, FloorLog2(static_cast<uint32_t>(pieces))), lg)
              << "total=" << total << " budget=" << budget << " pieces=" << pieces << " lo=" << lo;
        }
      }
    }
  }
}

// The receive-only grid: the measured choices at the decode shape (2 ranks, top-8, H = 7168, 132 SMs: a quarter of the
// CTAs at T=1, half at T=8, the whole grid for an FP8 dispatch at T=32 (128 items: one per CTA, session 64), all at
// T=128; half at EP4 T=32, 256 items, session 51); and for every shape and grid, within [min(4, G), G], the whole grid
// above 128 messages, a dispatch receive on fewer CTAs only where each item still has its own CTA there or would not
// on the whole grid either, a combine receive never smaller for more tokens, and its split as fine as the whole
// grid's with its last two CTAs (count check, metrics binning) holding no token.
TEST(ReceiveOnlyCtas, MeasuredChoicesAndTheCombineSplitKept) {
  EXPECT_EQ(ReceiveOnlyCtas(132, 2, 8, 1, 7168, false, true), 33);
  EXPECT_EQ(ReceiveOnlyCtas(132, 2, 8, 8, 7168, false, true), 66);
  EXPECT_EQ(ReceiveOnlyCtas(132, 2, 8, 16, 7168, false, true), 66);  // 64 items: one per CTA on half the grid
  EXPECT_EQ(ReceiveOnlyCtas(132, 2, 8, 32, 7168, false, true), 132);
  EXPECT_EQ(ReceiveOnlyCtas(132, 2, 8, 8, 7168, false, false), 66);  // BF16: 64 items (4 segments a message)
  EXPECT_EQ(ReceiveOnlyCtas(132, 2, 8, 16, 7168, false, false), 132);
  EXPECT_EQ(ReceiveOnlyCtas(132, 2, 8, 32, 7168, false, false), 66);  // 256 items: not one each on the whole grid
  EXPECT_EQ(ReceiveOnlyCtas(132, 2, 8, 128, 7168, false, true), 132);
  EXPECT_EQ(ReceiveOnlyCtas(132, 2, 8, 1, 7168, true, false), 33);
  EXPECT_EQ(ReceiveOnlyCtas(132, 2, 8, 32, 7168, true, false), 68);  // 2 CTAs per token (28 chunks) and 2 tokenless
  EXPECT_EQ(ReceiveOnlyCtas(132, 2, 8, 128, 7168, true, false), 132);
  EXPECT_EQ(ReceiveOnlyCtas(132, 4, 8, 16, 7168, false, true), 132);  // EP4 T=16: 128 items, as EP2 T=32
  EXPECT_EQ(ReceiveOnlyCtas(132, 4, 8, 32, 7168, false, true), 66);   // EP4 T=32: 128 messages, half (session 51)
  EXPECT_EQ(ReceiveOnlyCtas(132, 4, 8, 33, 7168, false, true), 132);
  for (int G : {1, 2, 3, 4, 5, 16, 33, 64, 78, 132}) {
    for (int R : {1, 2, 4, 8, 9, 64}) {
      for (int K : {1, 8, 12, 16}) {
        for (int hidden : {128, 2048, 7168, 8192}) {
          for (const bool combine : {false, true}) {
            for (const bool fp8 : {false, true}) {
              if (combine && fp8) continue;  // a combine has no FP8 payload
              int prev = 0;
              for (int T : {0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 33, 64, 65, 128, 129, 256}) {
                const int g = ReceiveOnlyCtas(G, R, K, T, hidden, combine, fp8);
                ASSERT_GE(g, std::min(G, 4)) << "G=" << G << " R=" << R << " K=" << K << " T=" << T;
                ASSERT_LE(g, G);
                const int64_t messages = int64_t{std::min(R, K)} * T;
                if (messages > 128) ASSERT_EQ(g, G);
                if (!combine) {
                  // Fewer CTAs than the grid: each item has its own CTA there (less the handle's and binning CTAs), or
                  // the whole grid would not give it one either (or a small T: at most 4 messages, a quarter).
                  const int64_t items = messages << DispatchRecvMinSplitLog2(DispatchRecvSlices(hidden, fp8));
                  if (g < G && messages > 4) {
                    ASSERT_TRUE(items <= g - 2 || items > G - 2)
                        << "G=" << G << " g=" << g << " R=" << R << " K=" << K << " T=" << T << " fp8=" << fp8;
                  }
                  continue;
                }
                ASSERT_GE(g, prev) << "G=" << G << " R=" << R << " K=" << K << " T=" << T;
                prev = g;
                if (g == G) continue;
                const CombineRecvSplit full = PlanCombineRecvSplit(hidden, T, G),
                                       sp = PlanCombineRecvSplit(hidden, T, g);
                ASSERT_EQ(sp.segs.divisor, full.segs.divisor) << "G=" << G << " g=" << g << " T=" << T;
                ASSERT_EQ(sp.ForCta(g - 1, T).num_tokens, 0) << "G=" << G << " g=" << g << " T=" << T;
                ASSERT_EQ(sp.ForCta(g - 2, T).num_tokens, 0) << "G=" << G << " g=" << g << " T=" << T;
              }
            }
          }
        }
      }
    }
  }
}

// NthSetBit16 equals a scan of the bits for every 16-bit mask and every n below its popcount.
TEST(NthSetBit16, EqualsTheBitScan) {
  for (uint32_t mask = 1; mask < (1u << 16); ++mask) {
    int n = 0;
    for (int bit = 0; bit < 16; ++bit) {
      if (((mask >> bit) & 1u) == 0) continue;
      ASSERT_EQ(NthSetBit16(mask, n), bit) << "mask=" << mask << " n=" << n;
      ++n;
    }
  }
}

}  // namespace
}  // namespace llep::kernels::cuda
