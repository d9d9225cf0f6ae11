// The dispatch phases: DispatchSend (route counts, token plans, encoded payload stores, completion, signals) and
// DispatchRecv (signals, packed layout, payload fan-out to rows, scales).
// Part of the one translation unit kernels/cuda/ll_kernels.cu (included only there; each part reopens the same private
// namespace): split by phase so a reader can hold each part; the generated code is that of one file.
#pragma once

#include "kernels/cuda/ll_call_gate.cuh"
#include "kernels/cuda/ll_routing.cuh"
#include "runtime/protocol/dispatch_msg.h"

namespace llep::kernels::cuda {
namespace {

// ------------------------------------------------------------------------------------------ dispatch

// Destinations one CTA counts and signals: ceil(R / G); the host launches enough CTAs to stay within it.
constexpr int kMaxDstPerCta = kMaxDestinationsPerCta;

struct DispatchSendShared {
  TokenPlan plan[kWarps];
  int tokens_to_dst[kMaxDstPerCta];
};

// Dispatch send's shared memory: DispatchSendShared, counts[E_loc], then PlanRound's scratch.
__host__ __device__ int64_t DispatchScratchOffset(int num_local_experts) {
  return protocol::AlignUp(static_cast<int64_t>(sizeof(DispatchSendShared)) + int64_t{4} * num_local_experts, 16);
}

/// Route-count words a dispatch receive loads early, one per thread (never the gate thread, which is reading the
/// call state then).
constexpr int kMaxEarlyRouteCounts = kGateThread;

/// Dispatch receive's shared memory: failed[4], msg_count[R], then the route-count words [2 halves][E] (loaded early,
/// or written by the table).
__host__ __device__ int64_t DispatchRecvWordsOffset(const protocol::LlShape& s) {
  return protocol::AlignUp(int64_t{4} * (4 + s.num_ranks), 16);
}
__host__ __device__ int64_t DispatchRecvSharedBytes(const protocol::LlShape& s) {
  return DispatchRecvWordsOffset(s) + int64_t{16} * s.num_experts;
}

/// 16-byte registers per lane a dispatch receive's copy holds (a segment's 512-byte slices; 8 KiB per warp would be
/// kCopyRegs): half of them, so the kernel has the registers for the receive's row resolution without spilling.
constexpr int kRecvCopyRegs = 8;

/// One lane's part of a dispatch payload chunk: 16 channels from c0 as bf16 (a, b) and, in FP8 mode, encoded
/// (code, the group's scale_inv).
struct ChunkPayload {
  uint4 a{}, b{}, code{};
  float scale_inv = 0.0f;
  int c0 = 0;
};

/// Loads the lane's channels of chunk ch of token t (no encoding, so the loads can be issued early).
__device__ __forceinline__ ChunkPayload LoadChunk(const DispatchParams& p, int t, int ch) {
  const int H = p.ctx.layout.shape.hidden;
  ChunkPayload cp;
  cp.c0 = ch * kChunk + (threadIdx.x % 32) * 16;
  if (cp.c0 < H) {
    const uint16_t* xr = p.x + static_cast<int64_t>(t) * H;
    cp.a = Ld16(xr + cp.c0);
    cp.b = Ld16(xr + cp.c0 + 8);
  }
  return cp;
}

/// FP8 mode: encodes a loaded chunk (whole warp).
__device__ __forceinline__ void EncodeChunk(const DispatchParams& p, ChunkPayload& cp) {
  if (p.mode.use_fp8) cp.code = EncodeFp8x16(cp.a, cp.b, p.mode.round_scale, &cp.scale_inv);
}

/// Before the first store the gate opens (ll_call_gate.cuh): a counting CTA counts its first destination's routes, a
/// token CTA loads its first payload chunks and plans its first round while the call state is read.
__device__ __forceinline__ void DispatchSend(const DispatchParams& p, CallGate& gate, uint8_t* smem) {
  const LlDeviceContext& c = p.ctx;
  const protocol::LlLayout& L = c.layout;
  const int R = L.shape.num_ranks, E_loc = static_cast<int>(L.local_experts.divisor), H = L.shape.hidden;
  const int K = p.num_topk;
  uint32_t seq = kSeqPending;
  const bool fp8 = p.mode.use_fp8;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, G = gridDim.x;
  auto* sh = reinterpret_cast<DispatchSendShared*>(smem);
  int* counts = reinterpret_cast<int*>(smem + sizeof(DispatchSendShared));
  auto* scratch = reinterpret_cast<PlanScratch*>(smem + DispatchScratchOffset(E_loc));
  const int num_chunks = (H + kChunk - 1) / kChunk;
  Trace(c, LlOp::kDispatch, kTraceSendStart);
  uint8_t* const lane_peer = LanePeer(c);

  // Route-block counts first, one destination per CTA counted from the last CTA (with T < G those CTAs have no
  // tokens, so counting overlaps the token work instead of following it).
  int k_dst = 0;
  for (int d = G - 1 - static_cast<int>(blockIdx.x); d < R; d += G, ++k_dst) {
    for (int i = tid; i < E_loc; i += kThreads) counts[i] = 0;
    if (tid == 0) sh->tokens_to_dst[k_dst] = 0;
    __syncthreads();
    for (int t0 = 0; t0 < p.num_tokens; t0 += kThreads) {  // a thread per token: one round of loads
      const int t = t0 + tid;
      bool hit_any = false;
      if (t < p.num_tokens) {
        WithTokenIds(c, p.topk_idx, t, K, LlOp::kDispatch, seq, [&](const auto& ids) {
#pragma unroll
          for (int k = 0; k < Len(ids); ++k) {
            const bool hit = ids[k] >= 0 && L.local_experts.Div(ids[k]) == d;
            if (hit) atomicAdd(&counts[ids[k] - d * E_loc], 1);
            hit_any |= hit;
          }
        });
      }
      const int tokens = __popc(gpu::WarpBallot(hit_any));
      if (lane == 0 && tokens > 0) atomicAdd(&sh->tokens_to_dst[k_dst], tokens);
    }
    __syncthreads();
    if ((seq = gate.Open()) == 0) return;
    const int half = protocol::HalfOfSeq(seq);
    // This call's plan for its combine (CarriedPlanArea): the header here, the route prefixes below, the token entries
    // after the token rounds. No plan when a CTA has more than one round of tokens (T > kWarps * G, beyond decode).
    if (d == 0 && tid == 0) KeepPlanHeader(c, half, p.num_tokens <= kWarps * G ? p.plan_key : 0, seq, p.num_tokens, K);
    uint8_t* const peer_d = c.peers[d];  // proxy peer (null): counts are staged in the route block sent at publish
    auto* remote_counts = reinterpret_cast<uint64_t*>(peer_d != nullptr ? peer_d + L.RouteRecvOffset(half, c.rank)
                                                                        : c.proxy_region + L.RouteSendOffset(half, d));
    for (int i = tid; i < E_loc; i += kThreads) {
      gpu::StoreRelaxedSys(remote_counts + i, protocol::PackRouteCount(seq, static_cast<uint32_t>(counts[i])));
    }
    if (warp == 0) KeepRoutePrefix(c, half, d, counts, E_loc);
    if (c.metrics != nullptr) {  // selections sent to d: a warp reduction per 32 local experts
      for (int i0 = warp * 32; i0 < E_loc; i0 += kThreads) {
        const unsigned v = gpu::WarpSum(i0 + lane < E_loc ? static_cast<unsigned>(counts[i0 + lane]) : 0u);
        if (lane == 0 && v != 0) AddMetric(c, c.metrics_layout.sent_selections(d), v);
      }
    }
    __syncthreads();
    if (tid == 0) FenceSys();  // the counts are ordered before d's signal, which this thread publishes
  }
  if (k_dst > 0) Trace(c, LlOp::kDispatch, kTraceCounted);

  // Tokens of this CTA: b, b + G, ...; a round holds up to kWarps of them.
  const int my_tokens =
      p.num_tokens > static_cast<int>(blockIdx.x) ? static_cast<int>(c.grid.Div(p.num_tokens - blockIdx.x + G - 1)) : 0;
  for (int round = 0; round < my_tokens; round += kWarps) {
    const int n = min(kWarps, my_tokens - round);
    // Items: (token, chunk) payload pieces plus one header item per token (c.send_items = num_chunks + 1 of them). A
    // warp's first item of the round is loaded before the plan (it does not depend on it), so the x loads are in
    // flight with the routing loads.
    const auto item_token = [&](int item) { return blockIdx.x + (round + c.send_items.Div(item)) * G; };
    const bool first_is_payload = warp < n * (num_chunks + 1) && c.send_items.Mod(warp) < num_chunks;
    const ChunkPayload first =
        first_is_payload ? LoadChunk(p, item_token(warp), c.send_items.Mod(warp)) : ChunkPayload{};
    PlanRoundAnyK(c, p.topk_idx, blockIdx.x + round * G, G, n, K, LlOp::kDispatch, seq, scratch, sh->plan);
    __syncthreads();
    if (round == 0) Trace(c, LlOp::kDispatch, kTracePlanned);
    if ((seq = gate.Open()) == 0) return;
    const int half = protocol::HalfOfSeq(seq);
    for (int item = warp; item < n * (num_chunks + 1); item += kWarps) {
      const int tw = c.send_items.Div(item), ch = item - tw * (num_chunks + 1);
      const TokenPlan& pl = sh->plan[tw];
      const int t = blockIdx.x + (round + tw) * G;
      if (ch < num_chunks) {
        ChunkPayload cp = item == warp ? first : LoadChunk(p, t, ch);
        EncodeChunk(p, cp);
        if (item == 0 && round == 0) Trace(c, LlOp::kDispatch, kTraceEncoded);
        const int c0 = cp.c0;
        const bool active = c0 < H;
        const auto store = [&](uint8_t* dstp) {
          if (fp8) {
            St16(dstp + c0, cp.code);
            if (lane % 8 == 0) reinterpret_cast<float*>(dstp + protocol::Fp8ScalesOffset(H))[c0 / 128] = cp.scale_inv;
          } else {
            St16(dstp + int64_t{c0} * 2, cp.a);
            St16(dstp + int64_t{c0} * 2 + 16, cp.b);
          }
        };
        bool to_proxy = false;
        for (unsigned m = pl.opens; m != 0; m &= m - 1) {
          const int k = __ffs(m) - 1, d = pl.dst[k];
          uint8_t* const base = PeerBase(c, lane_peer, d);
          to_proxy |= base == nullptr;
          if (base == nullptr || !active) continue;
          store(base + L.DispatchRecvOffset(half, c.rank, pl.slot[k], fp8));
        }
        // Proxy destinations share one staged copy of the payload; each gets its own write command after the round.
        if (to_proxy && active) store(c.proxy_region + L.DispatchPayloadOffset(half, t, fp8));
      } else {
        // Header per destination: lane i writes bytes [16i, 16i + 16) of the 80-byte header.
        for (unsigned m = pl.opens; m != 0; m &= m - 1) {
          const int k = __ffs(m) - 1, d = pl.dst[k];
          uint8_t* const base = PeerBase(c, lane_peer, d);
          if (lane >= 5) continue;
          // Word 4 + i is the token's i-th selection on rank d, in top-k order (registers only: no local array).
          uint32_t words[4] = {0, 0, 0, 0};
          int num_sel = 0;
          for (int j = 0; j < K; ++j) {
            if (pl.dst[j] != d) continue;
            const int wd = 4 + num_sel++;
            const uint32_t v = protocol::PackSelection(pl.id[j] - d * E_loc, pl.row[j]);
#pragma unroll
            for (int i = 0; i < 4; ++i) words[i] = wd == lane * 4 + i ? v : words[i];
          }
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int wd = lane * 4 + i;
            if (wd == 0) words[i] = static_cast<uint32_t>(t);
            if (wd == 1) words[i] = static_cast<uint32_t>(num_sel) | (protocol::kDispatchMsgVersion << 16);
            if (wd == 2) words[i] = seq;
            if (wd == 3) words[i] = fp8 ? protocol::kMsgFlagFp8 : 0u;
          }
          uint8_t* hdr = base != nullptr ? base + L.RouteHeaderOffset(L.RouteRecvOffset(half, c.rank), pl.slot[k])
                                         : c.proxy_region + L.RouteHeaderOffset(L.RouteSendOffset(half, d), pl.slot[k]);
          St16(hdr + lane * 16, make_uint4(words[0], words[1], words[2], words[3]));
        }
      }
    }
    __syncthreads();
    Trace(c, LlOp::kDispatch, kTraceStored);
    if (warp == 0) {
      // Lane i < n owns the round's token i (n <= kWarps <= 32). One increment per (token, destination) message,
      // after a system fence that follows the CTA barrier (it also orders the staged payloads before their commands).
      const bool mine = lane < n;
      if (mine) FenceSys();
      if (round == 0) Trace(c, LlOp::kDispatch, kTraceFenced);
      const TokenPlan& pl = sh->plan[mine ? lane : 0];
      const int t = blockIdx.x + (round + lane) * G;
      const unsigned opens = mine ? pl.opens : 0u;
      if (c.proxy_region != nullptr) {
        for (int k = 0; k < K; ++k) {  // warp-uniform: the k-th selection of every lane's token
          const int d = ((opens >> k) & 1u) ? pl.dst[k] : -1;
          const bool push = d >= 0 && IsProxyPeer(c, d);
          const protocol::FifoCmd cmd =
              push ? protocol::MakeWriteCmd(LlOp::kDispatch, half, d, L.DispatchPayloadOffset(half, t, fp8),
                                            L.DispatchRecvOffset(half, c.rank, pl.slot[k], fp8),
                                            protocol::DispatchPayloadStride(H, fp8))
                   : protocol::FifoCmd{};
          PushCmdWarp(c, d, cmd, push, LlOp::kDispatch, seq);
        }
      }
      for (unsigned m = opens; m != 0; m &= m - 1) AddDone(c, LlOp::kDispatch, half, pl.dst[__ffs(m) - 1]);
    }
    __syncthreads();
    Trace(c, LlOp::kDispatch, kTraceCounterDone);
  }
  if ((seq = gate.Open()) == 0) return;
  const int half = protocol::HalfOfSeq(seq);
  // The tokens' plan entries for the combine (CarriedPlanArea), from the one round a CTA plans: written here, after the
  // loop, because inside it the stores made the kernel spill.
  if (warp == 1 && lane < K && my_tokens <= kWarps) {
    for (int tw = 0; tw < my_tokens; ++tw) KeepPlanEntry(c, half, blockIdx.x + tw * G, K, lane, sh->plan[tw]);
  }
  if (tid == 0) {  // the publishing thread's loop (the compiler still computes its trip count with one division)
    k_dst = 0;
    for (int d = G - 1 - static_cast<int>(blockIdx.x); d < R; d += G, ++k_dst) {
      PublishWhenDone(c, LlOp::kDispatch, half, d, static_cast<uint32_t>(sh->tokens_to_dst[k_dst]), seq);
    }
  }
}

/// FP8: a lane's scale word of the payload slices [q0, q0 + nq) (512 channels each, nq <= 8): the fp32 scale_inv of
/// group w = 4 q0 + lane, or for packed UE8M0 word w = q0 + lane (the exponents of groups 4w .. 4w + 3). `per_row` is
/// the words per local expert and row of recv_scales (H/128 or H/512); w < 0 for a lane without a word.
struct ScaleWord {
  uint32_t bits = 0;
  int w = -1;
};
__device__ __forceinline__ ScaleWord LoadScaleWord(const float* scales, int per_row, int q0, int nq, bool ue8m0) {
  const int lane = threadIdx.x % 32;
  ScaleWord s;
  const int w = ue8m0 ? q0 + lane : 4 * q0 + lane;
  if (lane < (ue8m0 ? nq : 4 * nq) && w < per_row) {
    s.w = w;
    if (ue8m0) {
      const float4 f = *reinterpret_cast<const float4*>(scales + 4 * w);
      s.bits = uint32_t{Ue8m0FromScaleInv(f.x)} | uint32_t{Ue8m0FromScaleInv(f.y)} << 8 |
               uint32_t{Ue8m0FromScaleInv(f.z)} << 16 | uint32_t{Ue8m0FromScaleInv(f.w)} << 24;
    } else {
      s.bits = __float_as_uint(scales[w]);
    }
  }
  return s;
}

/// A message's place: its source and its index among that source's messages.
struct MessageRef {
  int src, j;
};

/// Messages counted over all sources (count(src) each, -1 for a masked source: none). Warp-collective.
template <typename Count>
__device__ __forceinline__ int WarpMessageTotal(const Count& count, int R) {
  const int lane = threadIdx.x % 32;
  int total = 0;
  for (int s0 = 0; s0 < R; s0 += 32) total += gpu::WarpSum(s0 + lane < R ? max(count(s0 + lane), 0) : 0);
  return total;
}

/// Message m (< WarpMessageTotal) of the messages taken in source order: a warp scan per 32 sources, so a warp
/// finds it without a CTA-wide scan and its barriers. Warp-collective, m warp-uniform.
template <typename Count>
__device__ __forceinline__ MessageRef LocateMessage(const Count& count, int R, int m) {
  const int lane = threadIdx.x % 32;
  int carry = 0;
  for (int s0 = 0; s0 < R; s0 += 32) {
    const int v = s0 + lane < R ? max(count(s0 + lane), 0) : 0;
    const int incl = WarpInclusiveScan(v);
    const int chunk = gpu::WarpShfl(incl, 31);
    if (m < carry + chunk) {
      // Sources of this chunk that end at or before m: a prefix of the lanes, so their count is m's source.
      const int q = __popc(gpu::WarpBallot(carry + incl <= m));
      return MessageRef{s0 + q, m - carry - gpu::WarpShfl(incl - v, q)};
    }
    carry += chunk;
  }
  return MessageRef{R - 1, 0};  // not reached for m < total
}

/// Whether the dispatch receive loads the route counts early (DispatchRecv): all sources NVLink peers (a proxy
/// source's block is in host memory, read once, after its signal) and one word per thread.
__device__ __forceinline__ bool DispatchRecvEarlyCounts(const LlDeviceContext& c) {
  return c.proxy_region == nullptr && c.layout.shape.num_experts <= kMaxEarlyRouteCounts;
}

/// The dispatch receive (one launch; every CTA):
///  1. waits for every source's signal (its message count; the peeked words when they are there already);
///  2. reads the route counts (words[half][src][le]; local expert le's block holds the rows of source 0, then of
///     source 1, ...). The last CTA (tokenless at small T) checks them all and writes the handle (recv_count,
///     layout_range, statistics). When the peek found every signal, the other CTAs skip steps 1-2: the early words
///     are the counts;
///  3. copies messages (one per (token, rank)) to their rows. A warp finds its message's source by a warp scan over
///     the message counts, not a CTA-wide scan (two barriers fewer on the way to the first copy), and each selection's
///     lane its row by summing the counts of the sources before the message's.
/// Tried (bench/RESULTS.md session 17): each selection's lane loading the counts it needs from global memory after
/// the header (a dependent load: as slow as the table), and the first message's loads issued before the table (held
/// in registers or as L1 prefetches, the kernel spilled: 1.10-1.15x).
__device__ __forceinline__ void DispatchRecv(const DispatchParams& p, CallGate& gate, uint8_t* smem) {
  const LlDeviceContext& c = p.ctx;
  const protocol::LlLayout& L = c.layout;
  const int R = L.shape.num_ranks, E_loc = static_cast<int>(L.local_experts.divisor), H = L.shape.hidden;
  const int T = L.shape.max_tokens_per_rank, E = L.shape.num_experts;
  const int64_t rows = L.shape.max_recv_rows();
  const bool fp8 = p.mode.use_fp8;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, G = gridDim.x;
  const bool writes_handle = blockIdx.x == G - 1;
  // Shared: failed flag, msg_count[R] (messages per source, -1 masked), then the route-count words [half][src][le]:
  // loaded early (DispatchRecvEarlyCounts), and where the table is built, its checked counts tagged with the call.
  int* failed = reinterpret_cast<int*>(smem);
  int* msg_count = failed + 4;
  auto* words = reinterpret_cast<uint64_t*>(smem + DispatchRecvWordsOffset(L.shape));
  const auto count_word = [&](int h, int i) {
    const int sr = L.local_experts.Div(i);
    return reinterpret_cast<const uint64_t*>(SrcBase(c, sr) + L.RouteRecvOffset(h, sr)) + (i - sr * E_loc);
  };

  Trace(c, LlOp::kDispatch, kTraceRecvStart);
  if (tid == 0) *failed = 0;
  const bool was_open = gate.is_open();
  // The route counts are tagged with their call (protocol::PackRouteCount), so thread i < E loads word i now, with
  // the signal peek and while the call state is read: for both halves in a receive-only launch (the half is not known
  // yet), for the call's half after a send phase. Usually (a hook's receive runs after its send finished everywhere)
  // the layout table below then needs no load after the signals (signals -> table 1.05 -> 0.70 us at T=1, recv_trace;
  // bench/RESULTS.md session 19). A word not tagged with the call is loaded again after the signals.
  const bool early = DispatchRecvEarlyCounts(c);
  const int known_half = was_open ? protocol::HalfOfSeq(gate.error_seq()) : -1;
  uint64_t early0 = 0, early1 = 0;
  if (early && tid < E) {
    if (known_half != 1) early0 = gpu::LoadRelaxedSys(count_word(0, tid));
    if (known_half != 0) early1 = gpu::LoadRelaxedSys(count_word(1, tid));
  }
  const bool peeked = !was_open && PeekSignals(c, LlOp::kDispatch);  // after the loads above: all in flight together
  if (early && tid < E) {
    words[tid] = early0;
    words[E + tid] = early1;
  }
  const uint32_t seq = gate.Open();  // its barrier also publishes *failed = 0, unless the gate was open already
  if (seq == 0) return;
  if (was_open) __syncthreads();
  const int half = protocol::HalfOfSeq(seq);
  // Usually (a hook's receive) the peek found every source's signal and the early words hold the route counts: then
  // a CTA other than the handle's waits for nothing and builds no table ("direct"), and each selection's lane sums
  // the counts it needs itself (route_count below). The wait, the table and their barriers took CTAs from the gate's
  // opening to their first message in 1.9 us of a 7 us receive at T=1 (recv_trace, bench/RESULTS.md session 21). The
  // handle's CTA builds the table as before: it writes recv_count and layout_range and checks every count of the call.
  const bool direct = peeked && early && c.mask == nullptr && !writes_handle && AllSignalsPeeked(c, half, seq, T);
  if (!direct) {
    WaitAllSources(c, LlOp::kDispatch, half, seq, T, p.wait_recv_cost_stats, msg_count, failed, peeked);
    __syncthreads();
    Trace(c, LlOp::kDispatch, kTraceSignals);
    if (*failed) return;
    // The layout table. A masked source (msg_count -1, rank masking) sends nothing: its route block is stale, not
    // read. A word still not tagged with the call after the source's signal is a stale or overwritten block: rejected.
    for (int i = tid; i < E; i += kThreads) {
      const int sr = L.local_experts.Div(i);
      uint32_t n = 0;
      if (msg_count[sr] >= 0) {
        uint64_t w = early ? words[half * E + i] : 0;
        if (protocol::RouteCountSeq(w) != seq) w = gpu::LoadRelaxedSys(count_word(half, i));
        n = protocol::RouteCountSeq(w) == seq ? protocol::RouteCountValue(w) : ~0u;
      }
      if (n > static_cast<uint32_t>(T)) failed[0] = 1 + sr;  // one source recorded, once, after the barrier
      words[half * E + i] = protocol::PackRouteCount(seq, n);
    }
    __syncthreads();
    if (*failed) {
      if (tid == 0) RecordError(c, protocol::kDeviceBadMessage, LlOp::kDispatch, *failed - 1, seq, -1);
      return;
    }
    if (writes_handle) {
      for (int le = tid; le < E_loc; le += kThreads) {
        int acc = 0;
        for (int sr = 0; sr < R; ++sr) {
          const int n = static_cast<int>(protocol::RouteCountValue(words[half * E + sr * E_loc + le]));
          p.layout_range[int64_t{le} * R + sr] = protocol::PackLayoutRange(n, acc);
          acc += n;
        }
        p.recv_count[le] = acc;
        if (p.cumulative_local_expert_recv_stats != nullptr) atomicAdd(&p.cumulative_local_expert_recv_stats[le], acc);
        if (c.metrics != nullptr)
          AddMetric(c, c.metrics_layout.expert_recv_tokens(p.layer, le), static_cast<uint64_t>(acc));
      }
    }
  } else {
    Trace(c, LlOp::kDispatch, kTraceSignals);
  }
  StampWaitEnd(c, seq);
  // Messages per source, and route count (src, le) of the call: ~0u for a word not tagged with it (a bad message).
  const auto messages = [&](int src) {
    return direct ? static_cast<int>(protocol::SignalValue(g_peeked_signals[half][src])) : msg_count[src];
  };
  const auto route_count = [&](int src, int le) -> uint32_t {
    const int i = src * E_loc + le;
    const uint64_t w = words[half * E + i];
    if (protocol::RouteCountSeq(w) == seq) return protocol::RouteCountValue(w);
    const uint64_t again = gpu::LoadRelaxedSys(count_word(half, i));  // only when direct: the table tags every word
    return protocol::RouteCountSeq(again) == seq ? protocol::RouteCountValue(again) : ~0u;
  };
  Trace(c, LlOp::kDispatch, kTraceRecvPlanned);

  // A message (one per (token, rank)) carries up to top-k rows. When there are fewer messages than CTAs, several
  // CTAs copy one message: its payload's 512-byte slices (a 16-byte store per lane) split into segments, each
  // with the FP8 scales of its channels. One warp storing all of a message's rows was the longest step of a small-T
  // receive (recv_trace at T=1: 2.9 us for the payload's 8 rows, then 1.4 us for their scales), and so was one item
  // storing a message's scales (6.4 us at T=1 against 4.8 for the payload items, session 21). Segments target one item
  // per CTA, not per warp: splitting down to a warp per slice at T=128 (1 rank) cost the dispatch kernel 7 %
  // (re-read headers, more warps fetching cold code), bench/RESULTS.md session 14.
  const int total = WarpMessageTotal(messages, R);
  const int64_t bytes = fp8 ? H : int64_t{2} * H;
  const int slices = static_cast<int>((bytes + 511) / 512);
  // 2^lg segments per message: the fewest with at most kRecvCopyRegs slices each (one copy pass, its loads issued
  // with the header's), doubled while they stay within the slices and one item per CTA. A power of two, so an item
  // splits into (message, segment) and a segment into slices by shifts: the runtime divisions did that in ~100
  // instructions, run once per item from a cold instruction cache (bench/RESULTS.md session 22).
  int lg = 0;
  while ((kRecvCopyRegs << lg) < slices) ++lg;
  while ((2 << lg) <= slices && (total << (lg + 1)) <= G) ++lg;
  const bool ue8m0 = p.mode.use_ue8m0;
  // recv_scales words per (local expert, row): H/512 or H/128 (num_packed_ue8m0, num_scales), as a shift: the
  // compiler turned the two constant divisions into one runtime division by the selected divisor.
  static_assert(protocol::kChannelsPerScale == 128 && protocol::kChannelsPerPackedUe8m0 == 512);
  const int scales_per_row = static_cast<int>(static_cast<unsigned>(H) >> (ue8m0 ? 9 : 7));
  for (int item = warp * G + blockIdx.x; item < total << lg; item += G * kWarps) {
    const int m = item >> lg, s = item & ((1 << lg) - 1);
    const int q0 = (s * slices) >> lg, nq = (((s + 1) * slices) >> lg) - q0;  // the segment's slices
    const int64_t lo = int64_t{q0} * 512, seg_bytes = min(bytes - lo, int64_t{nq} * 512);
    const MessageRef ref = LocateMessage(messages, R, m);
    const int src = ref.src, j = ref.j;
    const uint8_t* in = SrcBase(c, src);
    const uint8_t* hdr = in + L.RouteHeaderOffset(L.RouteRecvOffset(half, src), j);
    const uint8_t* payload = in + L.DispatchRecvOffset(half, src, j, fp8);
    // The header, the segment's bytes and its scales: independent loads, issued together.
    const uint32_t word = lane < 20 ? reinterpret_cast<const uint32_t*>(hdr)[lane] : 0u;
    uint4 v[kRecvCopyRegs];
    LoadCopyPass(payload + lo, seg_bytes, 0, v);
    const ScaleWord sw = fp8 ? LoadScaleWord(reinterpret_cast<const float*>(payload + protocol::Fp8ScalesOffset(H)),
                                             scales_per_row, q0, nq, ue8m0)
                             : ScaleWord{};
    const bool lead = s == 0;  // the message's first item records its errors and writes src_info
    const int src_token = static_cast<int>(gpu::WarpShfl(word, 0));
    const uint32_t w1 = gpu::WarpShfl(word, 1);
    const int num_sel = static_cast<int>(w1 & 0xFFFF);
    const bool ok = (w1 >> 16) == protocol::kDispatchMsgVersion && gpu::WarpShfl(word, 2) == seq &&
                    ((gpu::WarpShfl(word, 3) & protocol::kMsgFlagFp8) != 0) == fp8 && num_sel >= 1 && num_sel <= kK &&
                    src_token >= 0 && src_token < T;
    if (!ok) {
      if (lane == 0 && lead) RecordError(c, protocol::kDeviceBadMessage, LlOp::kDispatch, src, seq, j);
      continue;
    }
    // Lane i < num_sel resolves selection i to its output row; rejected selections are recorded and skipped.
    const uint32_t sel = gpu::WarpShfl(word, (4 + lane) & 31);
    int64_t my_row = -1;
    int my_le = 0, my_rr = 0;
    bool bad = false;
    if (lane < num_sel) {
      my_le = static_cast<int>(protocol::SelectionExpert(sel));
      const uint32_t r = protocol::SelectionRow(sel);
      // The row inside the local expert's packed block: the rows of the sources before src, then src's row r.
      uint32_t before = 0, n = 0;
      bad = my_le >= E_loc;
      for (int s0 = 0; s0 <= src && !bad; ++s0) {
        before += n;
        n = route_count(s0, my_le);
        bad = n > static_cast<uint32_t>(T);
      }
      bad |= r >= n;
      if (!bad) {
        my_rr = static_cast<int>(before + r);
        my_row = int64_t{my_le} * rows + my_rr;
        if (lead) p.src_info[my_row] = src_token;
      }
    }
    if (gpu::WarpAny(bad) && lane == 0 && lead) {
      RecordError(c, protocol::kDeviceBadMessage, LlOp::kDispatch, src, seq, j);
    }
    const unsigned targets = gpu::WarpBallot(my_row >= 0);
    // The segment goes through registers: loaded once, stored to every selection's row, with its scale words
    // (fp32: [E_loc, H/128, R*T]; packed UE8M0: int32 [E_loc, H/512, R*T], byte g % 4 of word g / 4 = group g).
    for (unsigned t = targets; t != 0; t &= t - 1) {
      const int i_sel = __ffs(t) - 1;
      const int64_t row = gpu::WarpShfl(my_row, i_sel);
      StoreCopyPass(static_cast<uint8_t*>(p.recv_x) + row * bytes + lo, seg_bytes, 0, v);
      const int le = gpu::WarpShfl(my_le, i_sel), rr = gpu::WarpShfl(my_rr, i_sel);
      if (sw.w >= 0) static_cast<uint32_t*>(p.recv_scales)[(int64_t{le} * scales_per_row + sw.w) * rows + rr] = sw.bits;
    }
  }
  if (c.trace != nullptr) {
    __syncthreads();
    Trace(c, LlOp::kDispatch, kTraceRecvEnd);
  }
}

}  // namespace
}  // namespace llep::kernels::cuda
