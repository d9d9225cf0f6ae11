// The host LL phases with every peer mapped in-process (no proxy): dispatch places each token's bytes where
// the definitions say, combine reduces in top-k order, corrupt messages are reported, and the command stream a
// proxied peer gets is coalesced (one write per run of consecutive tokens).
#include "kernels/host/ll_host.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/codec/fp8.h"
#include "runtime/protocol/ll_layout.h"

namespace llep::kernels {
namespace {

using protocol::LlShape;

struct World {
  explicit World(const LlShape& s) : layout(protocol::ComputeLlLayout(s)), peers(s.num_ranks) {
    for (int r = 0; r < s.num_ranks; ++r) {
      regions.emplace_back(new uint8_t[layout.total_bytes]());
      peers[r].direct_base = regions.back().get();
    }
  }
  HostRankContext Ctx(int r) const { return HostRankContext{layout, r, regions[r].get(), peers.data()}; }
  protocol::LlLayout layout;
  std::vector<std::unique_ptr<uint8_t[]>> regions;
  std::vector<HostPeer> peers;
};

struct Inputs {
  std::vector<uint16_t> x;
  std::vector<int64_t> topk;
  std::vector<float> w;
};

Inputs Random(const LlShape& s, int n, int k, std::mt19937* rng) {
  Inputs in;
  in.x.resize(static_cast<size_t>(n) * s.hidden);
  for (auto& v : in.x) v = FloatToBf16(std::uniform_real_distribution<float>(-2, 2)(*rng));
  for (int t = 0; t < n; ++t) {
    std::vector<int64_t> perm(s.num_experts);
    for (int e = 0; e < s.num_experts; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), *rng);
    for (int j = 0; j < k; ++j) {
      in.topk.push_back((*rng)() % 5 == 0 ? -1 : perm[j]);
      in.w.push_back(std::uniform_real_distribution<float>(0.1f, 1.0f)(*rng));
    }
  }
  return in;
}

protocol::DispatchCall SendCall(const uint16_t* x, protocol::DispatchMode mode) {
  protocol::DispatchCall c;
  c.x = x;
  c.mode = mode;
  return c;
}

// Every rank r draws random inputs of tokens(r) tokens, top-K, and sends them as the BF16 dispatch of call 1; with
// `weights` its topk weights travel as combine_weights.
template <typename Tokens>
void SendRandomBf16Dispatches(World* w, const LlShape& s, int K, Tokens tokens, bool weights, std::mt19937* rng,
                              std::vector<Inputs>* in, std::vector<RoutePlan>* plans) {
  plans->resize(s.num_ranks);
  for (int r = 0; r < s.num_ranks; ++r) {
    in->push_back(Random(s, tokens(r), K, rng));
    BuildRoutePlan(s, (*in)[r].topk.data(), tokens(r), K, &(*plans)[r]);
    protocol::DispatchCall call = SendCall((*in)[r].x.data(), {false, false, false});
    if (weights) {
      call.topk_weights = (*in)[r].w.data();
      call.carries_weights = true;
    }
    ASSERT_TRUE(DispatchSendHost(w->Ctx(r), {&call, &(*plans)[r], 1}));
  }
}

// A receive call writing into the given outputs.
protocol::DispatchCall RecvCall(protocol::DispatchMode mode, uint16_t* recv_x, int32_t* count, int32_t* src_info,
                                int64_t* layout_range) {
  protocol::DispatchCall c;
  c.mode = mode;
  c.recv_x = recv_x;
  c.recv_count = count;
  c.src_info = src_info;
  c.layout_range = layout_range;
  return c;
}

TEST(LlHostTest, Bf16DispatchAndCombineRoundTrip) {
  const LlShape s{8, 256, 8, 4};
  const int K = 3, E_loc = 2;
  const int64_t rows = s.max_recv_rows();
  World w(s);
  std::mt19937 rng(11);
  std::vector<Inputs> in;
  std::vector<RoutePlan> plans;
  const protocol::DispatchMode mode{false, false, false};
  SendRandomBf16Dispatches(
      &w, s, K, [](int r) { return 5 + r; }, false, &rng, &in, &plans);
  std::vector<std::vector<uint16_t>> recv_x(s.num_ranks, std::vector<uint16_t>(E_loc * rows * s.hidden));
  std::vector<std::vector<int64_t>> lr(s.num_ranks, std::vector<int64_t>(E_loc * s.num_ranks));
  for (int me = 0; me < s.num_ranks; ++me) {
    std::vector<uint32_t> tokens(s.num_ranks);
    for (int src = 0; src < s.num_ranks; ++src) {
      const uint64_t word =
          *reinterpret_cast<uint64_t*>(w.regions[me].get() + w.layout.SignalOffset(1, protocol::LlOp::kDispatch, src));
      ASSERT_EQ(protocol::SignalSeq(word), 1u);
      tokens[src] = protocol::SignalValue(word);
      EXPECT_EQ(tokens[src], static_cast<uint32_t>(plans[src].tokens_per_dst[me]));
    }
    std::vector<int32_t> count(E_loc), src_info(E_loc * rows);
    const protocol::DispatchCall call = RecvCall(mode, recv_x[me].data(), count.data(), src_info.data(), lr[me].data());
    ASSERT_EQ(DispatchRecvHost(w.Ctx(me), {&call, 1, tokens.data()}), "");
    // Every valid row holds exactly the source token it names.
    for (int le = 0; le < E_loc; ++le) {
      for (int src = 0; src < s.num_ranks; ++src) {
        const int64_t v = lr[me][le * s.num_ranks + src];
        const int64_t c = protocol::LayoutRangeCount(v), b = protocol::LayoutRangeBegin(v);
        int64_t prev = -1;
        for (int64_t row = b; row < b + c; ++row) {
          const int t = src_info[le * rows + row];
          EXPECT_GT(t, prev);  // token order inside a block
          prev = t;
          EXPECT_EQ(std::memcmp(&recv_x[me][(le * rows + row) * s.hidden], &in[src].x[t * s.hidden], s.hidden * 2), 0);
        }
      }
    }
  }
  // Identity experts: combine must return sum_k w * x in top-k order, rounded once to bf16.
  for (int r = 0; r < s.num_ranks; ++r) {
    protocol::CombineCall call;
    call.x = recv_x[r].data();
    call.layout_range = lr[r].data();
    ASSERT_TRUE(CombineSendHost(w.Ctx(r), {&call, 2}));
  }
  for (int r = 0; r < s.num_ranks; ++r) {
    const int n = 5 + r;
    std::vector<uint16_t> out(n * s.hidden, 0xFFFF);
    protocol::CombineCall call;
    call.topk_weights = in[r].w.data();
    call.out = out.data();
    CombineRecvHost(w.Ctx(r), {&call, &plans[r], 2});
    for (int t = 0; t < n; ++t) {
      for (int c = 0; c < s.hidden; ++c) {
        float acc = 0;
        for (int k = 0; k < K; ++k) {
          if (in[r].topk[t * K + k] >= 0)
            acc = std::fmaf(Bf16ToFloat(in[r].x[t * s.hidden + c]), in[r].w[t * K + k], acc);
        }
        ASSERT_EQ(out[t * s.hidden + c], FloatToBf16(acc)) << "rank " << r << " token " << t << " channel " << c;
      }
    }
  }
}

// combine_weights at dispatch (kernels/EXPERT_SIDE_COMBINE.md): the weights travel in the route blocks, each expert
// rank reduces a message's rows in its header's order and returns one row per (token, rank), and the home rank sums
// the ranks' rows in ascending rank order. Bit for bit against that order, with identity experts.
TEST(LlHostTest, ExpertReducedCombineIsExactInItsOrder) {
  const LlShape s{8, 256, 8, 4};
  const int K = 4, E_loc = 2;
  const int64_t rows = s.max_recv_rows();
  World w(s);
  std::mt19937 rng(29);
  std::vector<Inputs> in;
  std::vector<RoutePlan> plans;
  const protocol::DispatchMode mode{false, false, false};
  SendRandomBf16Dispatches(
      &w, s, K, [](int r) { return 6 + r % 2; }, true, &rng, &in, &plans);
  std::vector<std::vector<uint16_t>> recv_x(s.num_ranks, std::vector<uint16_t>(E_loc * rows * s.hidden));
  std::vector<std::vector<int64_t>> lr(s.num_ranks, std::vector<int64_t>(E_loc * s.num_ranks));
  std::vector<ExpertSidePlan> kept(s.num_ranks);
  for (int me = 0; me < s.num_ranks; ++me) {
    std::vector<uint32_t> tokens(s.num_ranks);
    for (int src = 0; src < s.num_ranks; ++src) tokens[src] = static_cast<uint32_t>(plans[src].tokens_per_dst[me]);
    std::vector<int32_t> count(E_loc), src_info(E_loc * rows);
    protocol::DispatchCall call = RecvCall(mode, recv_x[me].data(), count.data(), src_info.data(), lr[me].data());
    call.topk_weights = in[me].w.data();  // this rank's own call carries weights too
    call.carries_weights = true;
    ASSERT_EQ(DispatchRecvHost(w.Ctx(me), {&call, 1, tokens.data(), &kept[me]}), "");
    for (int src = 0; src < s.num_ranks; ++src) {
      ASSERT_EQ(kept[me].by_src[src].size(), tokens[src]);
      for (const ExpertSidePlan::Message& m : kept[me].by_src[src]) {
        for (int i = 0; i < m.n; ++i) {  // each kept row holds its token, and its weight is the token's
          EXPECT_EQ(std::memcmp(&recv_x[me][m.row[i] * s.hidden], &in[src].x[m.token * s.hidden], s.hidden * 2), 0);
          bool found = false;
          for (int k = 0; k < K; ++k) found |= in[src].w[m.token * K + k] == m.w[i];
          EXPECT_TRUE(found);
        }
      }
    }
  }
  for (int r = 0; r < s.num_ranks; ++r) {
    protocol::CombineCall call;
    call.x = recv_x[r].data();
    call.layout_range = lr[r].data();
    call.expert_reduced = true;
    ASSERT_TRUE(CombineSendHost(w.Ctx(r), {&call, 2, &kept[r]}));
  }
  for (int r = 0; r < s.num_ranks; ++r) {
    const int n = 6 + r % 2;
    for (int d = 0; d < s.num_ranks; ++d) {  // one row per token with a selection on d
      const uint64_t word =
          *reinterpret_cast<uint64_t*>(w.regions[r].get() + w.layout.SignalOffset(0, protocol::LlOp::kCombine, d));
      EXPECT_EQ(protocol::SignalValue(word), static_cast<uint32_t>(plans[r].tokens_per_dst[d]));
    }
    std::vector<uint16_t> out(n * s.hidden, 0xFFFF);
    protocol::CombineCall call;
    call.topk_weights = in[r].w.data();
    call.out = out.data();
    call.expert_reduced = true;
    CombineRecvHost(w.Ctx(r), {&call, &plans[r], 2});
    for (int t = 0; t < n; ++t) {
      for (int c = 0; c < s.hidden; ++c) {
        float acc = 0;
        for (int d = 0; d < s.num_ranks; ++d) {
          float part = 0;
          bool any = false;
          for (int k = 0; k < K; ++k) {
            const int64_t g = in[r].topk[t * K + k];
            if (g < 0 || g / E_loc != d) continue;
            part = std::fmaf(Bf16ToFloat(in[r].x[t * s.hidden + c]), in[r].w[t * K + k], part);
            any = true;
          }
          if (any) acc += Bf16ToFloat(FloatToBf16(part));
        }
        ASSERT_EQ(out[t * s.hidden + c], FloatToBf16(acc)) << "rank " << r << " token " << t << " channel " << c;
      }
    }
  }
}

/// Call 3 (half 1): rank 0 sends token 0 to rank 1, the other ranks send no tokens; `tamper` edits the route block
/// rank 1 got from rank 0, then rank 1 receives: the error.
template <typename Tamper>
std::string ReceiveTampered(Tamper tamper) {
  const LlShape s{4, 128, 4, 4};
  World w(s);
  const int64_t topk[] = {1, 0};
  const std::vector<uint16_t> x(2 * 128, FloatToBf16(1.0f));
  const protocol::DispatchCall send = SendCall(x.data(), {false, false, false});
  for (int r = 0; r < s.num_ranks; ++r) {
    RoutePlan plan;
    BuildRoutePlan(s, topk, r == 0 ? 2 : 0, 1, &plan);
    EXPECT_TRUE(DispatchSendHost(w.Ctx(r), {&send, &plan, 3}));
  }
  tamper(w.layout, w.regions[1].get() + w.layout.RouteRecvOffset(1, 0));
  std::vector<uint32_t> tokens = {0, 0, 0, 0};
  tokens[0] = 1;
  std::vector<uint16_t> recv_x(1 * 16 * 128);
  std::vector<int32_t> count(1), src_info(16);
  std::vector<int64_t> lr(4);
  protocol::DispatchCall call;
  call.recv_x = recv_x.data();
  call.recv_count = count.data();
  call.src_info = src_info.data();
  call.layout_range = lr.data();
  return DispatchRecvHost(w.Ctx(1), {&call, 3, tokens.data()});
}

TEST(LlHostTest, OverwrittenMessageIsReported) {
  // Pretend a later call (seq 5, same half) overwrote the header before it was read.
  const std::string error = ReceiveTampered([](const protocol::LlLayout& l, uint8_t* route_block) {
    reinterpret_cast<protocol::DispatchTokenHeader*>(route_block + l.RouteHeaderOffset(0, 0))->seq = 5;
  });
  EXPECT_NE(error.find("sequence 5 != 3"), std::string::npos) << error;
}

TEST(LlHostTest, StaleRouteCountIsReported) {
  // The count word of the call before on this half (seq 1): the block was not rewritten by this call.
  const std::string error = ReceiveTampered([](const protocol::LlLayout&, uint8_t* route_block) {
    reinterpret_cast<uint64_t*>(route_block)[0] = protocol::PackRouteCount(1, 1);
  });
  EXPECT_NE(error.find("route count of call 1, not 3"), std::string::npos) << error;
}

TEST(LlHostTest, ProxiedPeerGetsCoalescedCommands) {
  const LlShape s{8, 512, 4, 2};
  World w(s);
  std::vector<protocol::FifoCmd> ring(64);
  uint64_t head = 0, tail = 0, tail_cache = 0;
  const volatile int32_t abort_flag = 0;
  const protocol::FifoRingHandle fifo{ring.data(), &head, &tail, &tail_cache, &abort_flag, 64};
  w.peers[1].direct_base = nullptr;
  w.peers[1].fifo = &fifo;
  // Tokens 0..5 go to rank 1 (tokens 2 and 3 twice), token 6 stays local, token 7 goes to rank 1 again.
  const int64_t topk[] = {2, -1, 3, -1, 2, 3, 3, 2, 2, -1, 3, -1, 0, -1, 2, -1};
  std::vector<uint16_t> x(8 * 512, FloatToBf16(0.5f));
  RoutePlan plan;
  BuildRoutePlan(s, topk, 8, 2, &plan);
  const protocol::DispatchMode fp8{true, false, false};
  const protocol::DispatchCall call = SendCall(x.data(), fp8);
  ASSERT_TRUE(DispatchSendHost(w.Ctx(0), {&call, &plan, 1}));
  ASSERT_EQ(head, 4u);  // route block, payload run t0..t5, payload t7, signal
  protocol::FifoCmdFields f[4];
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(protocol::DecodeCmd(ring[i], &f[i]));
  const int64_t stride = protocol::DispatchPayloadStride(512, true);
  EXPECT_EQ(f[0].bytes, static_cast<uint64_t>(protocol::RouteBlockUsedBytes(s, 7)));
  EXPECT_EQ(f[1].bytes, static_cast<uint64_t>(6 * stride));
  EXPECT_EQ(f[1].remote_off, static_cast<uint64_t>(w.layout.DispatchRecvOffset(1, 0, 0, true)));
  EXPECT_EQ(f[2].bytes, static_cast<uint64_t>(stride));
  EXPECT_EQ(f[2].local_off, static_cast<uint64_t>(w.layout.DispatchPayloadOffset(1, 7, true)));
  EXPECT_EQ(f[2].remote_off, static_cast<uint64_t>(w.layout.DispatchRecvOffset(1, 0, 6, true)));
  EXPECT_EQ(f[3].opcode, protocol::FifoOpcode::kSignal);
  EXPECT_EQ(f[3].signal_word, protocol::PackSignal(1, 7));
}

}  // namespace
}  // namespace llep::kernels

namespace llep::kernels {
namespace {

TEST(LlHostTest, VectorisedAccumulateMatchesFmafBitForBit) {
  std::mt19937 rng(17);
  const int n = 7168 + 5;  // odd tail exercises the scalar remainder
  std::vector<uint16_t> row(n);
  std::vector<float> acc(n), ref(n);
  for (int trial = 0; trial < 50; ++trial) {
    for (int c = 0; c < n; ++c) {
      row[c] = static_cast<uint16_t>(rng());  // every bf16 pattern: subnormals, inf, NaN included
      acc[c] = ref[c] =
          std::ldexp(std::uniform_real_distribution<float>(-1, 1)(rng), static_cast<int>(rng() % 60) - 30);
    }
    const float w = std::uniform_real_distribution<float>(0.01f, 2.0f)(rng);
    AccumulateWeightedRow(acc.data(), row.data(), w, n);
    for (int c = 0; c < n; ++c) ref[c] = std::fmaf(Bf16ToFloat(row[c]), w, ref[c]);
    for (int c = 0; c < n; ++c) {
      if (std::isnan(ref[c])) {
        ASSERT_TRUE(std::isnan(acc[c]));
      } else {
        ASSERT_EQ(FloatBits(acc[c]), FloatBits(ref[c])) << "element " << c;
      }
    }
  }
}

}  // namespace
}  // namespace llep::kernels

namespace llep::kernels {
namespace {

TEST(LlHostTest, VectorisedEncodeMatchesReference) {
  // Every bf16 pattern (NaN, inf, subnormals included) in every group position, under amax values that put
  // the scaled values on both sides of 2^-6 and 448, for plain and power-of-two scales.
  const int H = 512;
  std::vector<uint16_t> x(H);
  std::vector<uint8_t> got(protocol::Fp8PayloadBytes(H)), want(protocol::Fp8PayloadBytes(H));
  std::mt19937 rng(23);
  for (bool round_scale : {false, true}) {
    const protocol::DispatchMode mode{true, round_scale, false};
    for (uint32_t base = 0; base < 0x10000; base += H - 4) {
      for (int c = 0; c < H; ++c) x[c] = static_cast<uint16_t>(base + c);
      // Pin each group's amax to a random finite value so most patterns land in range.
      for (int g = 0; g < H / 128; ++g) {
        x[g * 128 + (rng() % 128)] = FloatToBf16(std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20));
      }
      EncodeDispatchPayload(x.data(), H, mode, got.data());
      EncodeDispatchPayloadReference(x.data(), H, mode, want.data());
      for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << "byte " << i << " base " << base;
    }
    for (int trial = 0; trial < 2000; ++trial) {  // realistic activations
      for (auto& v : x)
        v = FloatToBf16(
            std::ldexp(std::uniform_real_distribution<float>(-1, 1)(rng), static_cast<int>(rng() % 30) - 15));
      EncodeDispatchPayload(x.data(), H, mode, got.data());
      EncodeDispatchPayloadReference(x.data(), H, mode, want.data());
      ASSERT_EQ(got, want) << "trial " << trial;
    }
  }
}

}  // namespace
}  // namespace llep::kernels
