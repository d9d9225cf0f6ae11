// The combine phases: CombineSend (rows back to their tokens' ranks) and CombineRecv (the deterministic fp32
// top-k reduction).
// Part of the one translation unit kernels/cuda/ll_kernels.cu (included only there; each part reopens the same private
// namespace): split by phase so a reader can hold each part; the generated code is that of one file.
#pragma once

#include "kernels/cuda/ll_routing.cuh"

namespace llep::kernels::cuda {
namespace {

// ------------------------------------------------------------------------------------------ combine

__device__ void CombineSend(const CombineParams& p, uint32_t seq, uint8_t* smem) {
  const LlDeviceContext& c = p.ctx;
  const protocol::LlLayout& L = c.layout;
  const int R = L.shape.num_ranks, E_loc = L.shape.num_local_experts(), H = L.shape.hidden;
  const int T = L.shape.max_tokens_per_rank, E = L.shape.num_experts;
  const int64_t rows = L.shape.max_recv_rows(), row_bytes = protocol::CombineRowBytes(H);
  const int half = protocol::HalfOfSeq(seq);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, G = gridDim.x;
  // Shared: count and begin (row in the expert's packed block) indexed q = le * R + d as layout_range; pos, the
  // same counts indexed d * E_loc + le and scanned (the home rank's receive area holds its blocks in local-expert
  // order); item start (flattened rows, q order, so concurrent warps spread over all destinations); rows_to[d].
  int* warp_sums = reinterpret_cast<int*>(smem);
  int* cnt = warp_sums + kWarps;
  int* beg = cnt + E;
  int* pos = beg + E;
  int* start = pos + E;
  int* rows_to = start + E;
  Trace(c, LlOp::kCombine, kTraceSendStart);
  uint8_t* const lane_peer = LanePeer(c);

  for (int q = tid; q < E; q += kThreads) {
    const int64_t v = p.layout_range[q];
    const int64_t n = protocol::LayoutRangeCount(v), b = protocol::LayoutRangeBegin(v);
    const bool ok = n <= T && b >= 0 && b + n <= rows;
    if (!ok) RecordError(c, protocol::kDeviceBadLayoutRange, LlOp::kCombine, q % R, seq, q);
    cnt[q] = ok ? static_cast<int>(n) : 0;
    beg[q] = ok ? static_cast<int>(b) : 0;
    pos[(q % R) * E_loc + q / R] = cnt[q];
  }
  __syncthreads();
  const int pos_total = BlockExclusiveScan(pos, E, warp_sums);  // (one scan instead of a serial loop per rank)
  for (int d = tid; d < R; d += kThreads) {
    const int n = (d + 1 < R ? pos[(d + 1) * E_loc] : pos_total) - pos[d * E_loc];
    const bool ok = n <= L.combine_rows_per_src;  // more rows than the home rank's receive area holds: send none
    if (!ok) RecordError(c, protocol::kDeviceBadLayoutRange, LlOp::kCombine, d, seq, n);
    rows_to[d] = ok ? n : -1;
  }
  __syncthreads();
  for (int q = tid; q < E; q += kThreads) start[q] = rows_to[q % R] < 0 ? 0 : cnt[q];
  __syncthreads();
  const int total = BlockExclusiveScan(start, E, warp_sums);
  Trace(c, LlOp::kCombine, kTracePlanned);

  for (int m = warp * G + blockIdx.x; m < total; m += G * kWarps) {
    const int q = FindBlock(start, E, m), le = q / R, d = q % R, i = m - start[q];
    const int64_t src_row = beg[q] + i;
    const uint8_t* src = !p.zero_copy ? reinterpret_cast<const uint8_t*>(p.x + (int64_t{le} * rows + src_row) * H)
                                      : c.local + L.CombineSendOffset(kZeroCopyHalf, le, src_row);
    const int64_t recv_off = L.CombineRecvOffset(half, c.rank, pos[d * E_loc + le] - pos[d * E_loc] + i);
    uint8_t* const peer = PeerBase(c, lane_peer, d);
    // A proxy peer's row is staged in c_send of this half (a zero-copy row is in kZeroCopyHalf of the GPU region).
    uint8_t* dst = peer != nullptr ? peer + recv_off : c.proxy_region + L.CombineSendOffset(half, le, src_row);
    for (int64_t base = 0; base < row_bytes; base += kCopyPassBytes) {
      uint4 v[kCopyRegs];
      LoadCopyPass(src, row_bytes, base, v);
      StoreCopyPass(dst, row_bytes, base, v);
    }
    __syncwarp();
    if (lane == 0) {
      FenceSys();
      if (peer == nullptr) {
        // One write per (local expert, destination) block, not per row: the block is contiguous in the staging and
        // at the destination (row stride on both sides), and messages, not bytes, bound proxy transports (per-row
        // writes measured in bench/RESULTS.md). The warp that stages the block's last row sends it; the acquire
        // of its count makes the other warps' fenced rows part of what its command releases.
        uint64_t* staged = c.proxy_blocks + int64_t{half} * E + q;
        uint64_t before;
        asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;" : "=l"(before) : "l"(staged) : "memory");
        if (before + 1 == static_cast<uint64_t>(cnt[q])) {
          *staged = 0;  // the next combine on this half is a later launch (stream order)
          PushCmd(c, d,
                  protocol::MakeWriteCmd(LlOp::kCombine, half, d, L.CombineSendOffset(half, le, beg[q]),
                                         recv_off - int64_t{i} * L.combine_stride,
                                         int64_t{cnt[q] - 1} * L.combine_stride + row_bytes),
                  LlOp::kCombine, seq);
        }
      }
      AddDone(c, LlOp::kCombine, half, d);
    }
  }
  __syncthreads();
  Trace(c, LlOp::kCombine, kTraceCounterDone);
  for (int d = blockIdx.x; tid == 0 && d < R; d += G) {
    PublishWhenDone(c, LlOp::kCombine, half, d, static_cast<uint32_t>(max(rows_to[d], 0)), seq);
  }
}

struct CombineRecvPlan {
  const uint8_t* row[kK];  ///< the returned row (local region, or proxy_region for a proxy source), null = skipped
  float weight[kK];
};

/// acc[i] += weight[k] * row_k[c0 + i] over the token's slots in top-k order (fp32 fma, skipped slots add
/// nothing, as the CPU backend): the K rows' loads are issued together, then the sums run in order.
template <int kMaxK>
__device__ __forceinline__ void ReduceChunk(const CombineRecvPlan& rp, int K, int c0, float (&acc)[8]) {
  uint4 v[kMaxK];
#pragma unroll
  for (int k = 0; k < kMaxK; ++k) {
    const uint8_t* row = k < K ? rp.row[k] : nullptr;
    v[k] = row != nullptr ? Ld16(row + int64_t{c0} * 2) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int k = 0; k < kMaxK; ++k) {
    if (k >= K || rp.row[k] == nullptr) continue;
    const float w = rp.weight[k];
    const uint32_t ws[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[2 * i] = __fmaf_rn(BitsToFloat(ws[i] << 16), w, acc[2 * i]);
      acc[2 * i + 1] = __fmaf_rn(BitsToFloat(ws[i] & 0xFFFF0000u), w, acc[2 * i + 1]);
    }
  }
}

__device__ void CombineRecv(const CombineParams& p, uint32_t seq, uint8_t* smem) {
  const LlDeviceContext& c = p.ctx;
  const protocol::LlLayout& L = c.layout;
  const int R = L.shape.num_ranks, E_loc = L.shape.num_local_experts(), H = L.shape.hidden;
  const int E = L.shape.num_experts, K = p.num_topk;
  const int half = protocol::HalfOfSeq(seq);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, G = gridDim.x;
  // Shared: failed, warp sums, got[R] (rows each source announced), routed[R] (rows this rank routed to each
  // expert rank), expert counts -> exclusive prefix [E], token plans, per-round row plans.
  int* failed = reinterpret_cast<int*>(smem);
  int* warp_sums = failed + 4;
  int* got = warp_sums + kWarps;
  int* routed = got + R;
  int* prefix = routed + R;
  auto* plans = reinterpret_cast<TokenPlan*>(smem + protocol::AlignUp(int64_t{4} * (4 + kWarps + 2 * R + E), 16));
  auto* rplans = reinterpret_cast<CombineRecvPlan*>(plans + kWarps);
  auto* scratch = reinterpret_cast<PlanScratch*>(rplans + kWarps);

  // Everything that depends on the routing alone runs before the wait for the expert ranks: the per-expert
  // counts (a thread per token), the rows routed to each rank, the positions, the first round's token plans.
  Trace(c, LlOp::kCombine, kTraceRecvStart);
  if (tid == 0) *failed = 0;
  for (int g = tid; g < E; g += kThreads) prefix[g] = 0;
  __syncthreads();
  for (int t = tid; t < p.num_tokens; t += kThreads) {
    WithTokenIds(c, p.topk_idx, t, K, LlOp::kCombine, seq, [&](const auto& ids) {
#pragma unroll
      for (int k = 0; k < Len(ids); ++k) {
        if (ids[k] >= 0) atomicAdd(&prefix[ids[k]], 1);
      }
    });
  }
  __syncthreads();
  const int routed_total = BlockExclusiveScan(prefix, E, warp_sums);  // experts in [rank][local] order
  for (int d = tid; d < R; d += kThreads) {
    routed[d] = (d + 1 < R ? prefix[(d + 1) * E_loc] : routed_total) - prefix[d * E_loc];
  }
  Trace(c, LlOp::kCombine, kTraceRecvPlanned);

  const int my_tokens = p.num_tokens > static_cast<int>(blockIdx.x) ? (p.num_tokens - blockIdx.x + G - 1) / G : 0;
  for (int round = 0; round < my_tokens || round == 0; round += kWarps) {
    const int n = max(0, min(kWarps, my_tokens - round));
    PlanRoundAnyK(c, p.topk_idx, blockIdx.x + round * G, G, n, K, LlOp::kCombine, seq, scratch, plans);
    if (warp < n) {
      const int t = blockIdx.x + (round + warp) * G;
      __syncwarp();
      if (lane < K) {
        const int g = plans[warp].id[lane];
        const uint8_t* row = nullptr;
        if (g >= 0) {
          const int d = g / E_loc;
          const int pos_in = prefix[g] - prefix[d * E_loc] + plans[warp].row[lane];
          row = SrcBase(c, d) + L.CombineRecvOffset(half, d, pos_in);
        }
        rplans[warp].row[lane] = row;
        rplans[warp].weight[lane] = p.topk_weights[int64_t{t} * K + lane];
      }
    }
    if (round == 0) {
      // Each expert rank must return exactly the rows this rank routed to it.
      WaitAllSources(c, LlOp::kCombine, half, seq, L.combine_rows_per_src, p.wait_recv_cost_stats, got, failed);
      __syncthreads();
      Trace(c, LlOp::kCombine, kTraceSignals);
      StampWaitEnd(c, seq);
      for (int d = tid; d < R; d += kThreads) {
        if (!*failed && routed[d] != got[d]) {
          RecordError(c, protocol::kDeviceBadMessage, LlOp::kCombine, d, seq, got[d]);
          *failed = 1;
        }
      }
    }
    __syncthreads();
    if (*failed) return;
    const int chunks = (H + 255) / 256;  // 8 channels per lane
    for (int item = warp; item < n * chunks; item += kWarps) {
      const int tw = item / chunks, ch = item % chunks;
      const int c0 = ch * 256 + lane * 8;
      if (c0 >= H) continue;
      const int t = blockIdx.x + (round + tw) * G;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (K <= 8) {
        ReduceChunk<8>(rplans[tw], K, c0, acc);
      } else {
        ReduceChunk<kK>(rplans[tw], K, c0, acc);
      }
      uint32_t o[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        o[i] = uint32_t{FloatToBf16(acc[2 * i])} | (uint32_t{FloatToBf16(acc[2 * i + 1])} << 16);
      St16(p.out + int64_t{t} * H + c0, make_uint4(o[0], o[1], o[2], o[3]));
    }
    __syncthreads();
  }
  Trace(c, LlOp::kCombine, kTraceRecvEnd);
}

}  // namespace
}  // namespace llep::kernels::cuda
