// The host LL combine phases (kernels/host/ll_host.h): each valid row back to its home rank, or for an expert-side
// combine one reduced row per (token, rank) (kernels/EXPERT_SIDE_COMBINE.md); the home rank's fp32 reduction.
#include <algorithm>
#include <vector>

#include "kernels/codec/fp8.h"
#include "kernels/host/ll_host.h"
#include "kernels/host/ll_host_internal.h"

namespace llep::kernels {

using protocol::LlOp;

namespace {

// The expert-side combine's send: per message received from home rank d (ExpertSidePlan), its rows reduced in the
// header's order with fmaf in fp32, rounded once, stored at the token's position of d's receive area (staged in
// c_part and written in runs of consecutive tokens for a proxy destination). The signal counts the rows.
bool CombineSendReducedHost(const HostRankContext& ctx, const CombineSendArgs& a) {
  const protocol::LlLayout& L = ctx.layout;
  const protocol::CombineCall& call = *a.call;
  const ExpertSidePlan& plan = *a.expert_plan;
  const int half = protocol::HalfOfSeq(a.seq), R = L.shape.num_ranks, H = L.shape.hidden;
  const int64_t rows = L.shape.max_recv_rows(), row_bytes = protocol::CombineRowBytes(H);
  std::vector<float> acc(static_cast<size_t>(H));
  for (int d = 0; d < R; ++d) {
    if (IsMasked(ctx, d)) continue;
    const HostPeer& peer = ctx.peers[d];
    const std::vector<ExpertSidePlan::Message>& msgs = plan.by_src[static_cast<size_t>(d)];
    int run_t = -1, run_len = 0;
    const auto flush = [&]() {
      if (run_len == 0) return true;
      const bool ok =
          PushWrite(peer, LlOp::kCombine, half, d, L.CombinePartOffset(half, d, run_t),
                    L.CombineRecvOffset(half, ctx.rank, run_t), (run_len - 1) * L.combine_stride + row_bytes);
      run_len = 0;
      return ok;
    };
    for (const ExpertSidePlan::Message& m : msgs) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int i = 0; i < m.n; ++i) {
        const int64_t le = m.row[i] / rows, r = m.row[i] % rows;
        const auto* x = !call.zero_copy ? call.x + m.row[i] * H
                                        : reinterpret_cast<const uint16_t*>(
                                              ctx.local_base + L.CombineSendOffset(half, static_cast<int>(le), r));
        AccumulateWeightedRow(acc.data(), x, m.w[i], H);
      }
      uint8_t* to = peer.direct_base != nullptr ? peer.direct_base + L.CombineRecvOffset(half, ctx.rank, m.token)
                                                : ctx.local_base + L.CombinePartOffset(half, d, m.token);
      auto* out = reinterpret_cast<uint16_t*>(to);
      for (int c = 0; c < H; ++c) out[c] = FloatToBf16(acc[c]);
      if (peer.direct_base != nullptr) continue;
      if (run_len > 0 && m.token == run_t + run_len) {
        ++run_len;
        continue;
      }
      if (!flush()) return false;
      run_t = m.token, run_len = 1;
    }
    // (A mapped peer has no run to flush.)
    if (!flush() || !SignalPeer(ctx, peer, LlOp::kCombine, half, d,
                                protocol::PackSignal(a.seq, static_cast<uint32_t>(msgs.size())))) {
      return false;
    }
  }
  return true;
}

}  // namespace

bool CombineSendHost(const HostRankContext& ctx, const CombineSendArgs& a) {
  if (a.call->expert_reduced) return CombineSendReducedHost(ctx, a);
  const protocol::LlLayout& L = ctx.layout;
  const protocol::CombineCall& call = *a.call;
  const int half = protocol::HalfOfSeq(a.seq), R = L.shape.num_ranks, H = L.shape.hidden;
  const int E_loc = L.shape.num_local_experts();
  const int64_t rows = L.shape.max_recv_rows(), row_bytes = protocol::CombineRowBytes(H);
  for (int d = 0; d < R; ++d) {
    if (IsMasked(ctx, d)) continue;
    const HostPeer& peer = ctx.peers[d];
    int64_t pos = 0;
    for (int le = 0; le < E_loc; ++le) {
      const int64_t lr = call.layout_range[static_cast<size_t>(le) * R + d];
      const int64_t c = protocol::LayoutRangeCount(lr), b = protocol::LayoutRangeBegin(lr);
      if (c == 0) continue;
      for (int64_t i = 0; i < c; ++i) {
        const uint8_t* src_row = !call.zero_copy ? reinterpret_cast<const uint8_t*>(call.x + (le * rows + b + i) * H)
                                                 : ctx.local_base + L.CombineSendOffset(half, le, b + i);
        if (peer.direct_base != nullptr) {
          std::memcpy(peer.direct_base + L.CombineRecvOffset(half, ctx.rank, pos + i), src_row,
                      static_cast<size_t>(row_bytes));
        } else if (!call.zero_copy) {
          std::memcpy(ctx.local_base + L.CombineSendOffset(half, le, b + i), src_row, static_cast<size_t>(row_bytes));
        }
      }
      // Staging rows and receive slots share CombineRowStride, so one (expert, home rank) block is one write.
      if (peer.direct_base == nullptr &&
          !PushWrite(peer, LlOp::kCombine, half, d, L.CombineSendOffset(half, le, b),
                     L.CombineRecvOffset(half, ctx.rank, pos), (c - 1) * L.combine_stride + row_bytes)) {
        return false;
      }
      pos += c;
    }
    if (!SignalPeer(ctx, peer, LlOp::kCombine, half, d, protocol::PackSignal(a.seq, static_cast<uint32_t>(pos)))) {
      return false;
    }
  }
  return true;
}

void CombineRecvHost(const HostRankContext& ctx, const CombineRecvArgs& a) {
  const protocol::LlLayout& L = ctx.layout;
  const protocol::CombineCall& call = *a.call;
  const int half = protocol::HalfOfSeq(a.seq), H = L.shape.hidden;
  const RoutePlan& plan = *a.plan;
  std::vector<float> acc(static_cast<size_t>(H));
  std::vector<uint8_t> holds(static_cast<size_t>(L.shape.num_ranks));
  for (int t = 0; t < plan.num_tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    if (call.expert_reduced) {
      // One partial row per expert rank holding a selection of t, at position t, summed in ascending rank order.
      std::fill(holds.begin(), holds.end(), 0);
      for (int k = 0; k < plan.num_topk; ++k) {
        const int r = plan.at(t, k).dst_rank;
        if (r >= 0 && !IsMasked(ctx, r)) holds[static_cast<size_t>(r)] = 1;
      }
      for (int r = 0; r < L.shape.num_ranks; ++r) {
        if (holds[static_cast<size_t>(r)] == 0) continue;
        AccumulateWeightedRow(
            acc.data(), reinterpret_cast<const uint16_t*>(ctx.local_base + L.CombineRecvOffset(half, r, t)), 1.0f, H);
      }
    }
    for (int k = 0; k < plan.num_topk && !call.expert_reduced; ++k) {
      const RouteEntry& e = plan.at(t, k);
      if (e.dst_rank < 0 || IsMasked(ctx, e.dst_rank)) continue;
      const float w = call.topk_weights[static_cast<size_t>(t) * plan.num_topk + k];
      const auto* row =
          reinterpret_cast<const uint16_t*>(ctx.local_base + L.CombineRecvOffset(half, e.dst_rank, e.pos));
      AccumulateWeightedRow(acc.data(), row, w, H);
    }
    uint16_t* out = call.out + static_cast<size_t>(t) * H;
    for (int c = 0; c < H; ++c) out[c] = FloatToBf16(acc[c]);
  }
}

}  // namespace llep::kernels
