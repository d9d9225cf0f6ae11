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
__host__ __device__ int64_t DispatchScratchOffset(const protocol::LlShape& s) {
  return protocol::AlignUp(static_cast<int64_t>(sizeof(DispatchSendShared)) + int64_t{4} * s.num_local_experts(), 16);
}

/// Route-count words a dispatch receive loads early, one per thread (never the gate thread, which is reading the
/// call state then).
constexpr int kMaxEarlyRouteCounts = kGateThread;

/// Dispatch receive's shared memory: failed[4], msg_count[R], cnt[E], begin[E], then (E <= kMaxEarlyRouteCounts)
/// the early route-count words [2][E].
__host__ __device__ int64_t DispatchRecvEarlyOffset(const protocol::LlShape& s) {
  return protocol::AlignUp(int64_t{4} * (4 + s.num_ranks + 2 * int64_t{s.num_experts}), 16);
}
__host__ __device__ int64_t DispatchRecvSharedBytes(const protocol::LlShape& s) {
  return DispatchRecvEarlyOffset(s) + (s.num_experts <= kMaxEarlyRouteCounts ? int64_t{16} * s.num_experts : 0);
}

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
  auto* scratch = reinterpret_cast<PlanScratch*>(smem + DispatchScratchOffset(L.shape));
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
  const int my_tokens = p.num_tokens > static_cast<int>(blockIdx.x) ? (p.num_tokens - blockIdx.x + G - 1) / G : 0;
  for (int round = 0; round < my_tokens; round += kWarps) {
    const int n = min(kWarps, my_tokens - round);
    // Items: (token, chunk) payload pieces plus one header item per token. A warp's first item of the round is
    // loaded before the plan (it does not depend on it), so the x loads are in flight with the routing loads.
    const auto item_token = [&](int item) { return blockIdx.x + (round + item / (num_chunks + 1)) * G; };
    const bool first_is_payload = warp < n * (num_chunks + 1) && warp % (num_chunks + 1) < num_chunks;
    const ChunkPayload first =
        first_is_payload ? LoadChunk(p, item_token(warp), warp % (num_chunks + 1)) : ChunkPayload{};
    PlanRoundAnyK(c, p.topk_idx, blockIdx.x + round * G, G, n, K, LlOp::kDispatch, seq, scratch, sh->plan);
    __syncthreads();
    if (round == 0) Trace(c, LlOp::kDispatch, kTracePlanned);
    if ((seq = gate.Open()) == 0) return;
    const int half = protocol::HalfOfSeq(seq);
    for (int item = warp; item < n * (num_chunks + 1); item += kWarps) {
      const int tw = item / (num_chunks + 1), ch = item % (num_chunks + 1);
      const TokenPlan& pl = sh->plan[tw];
      const int t = item_token(item);
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
  k_dst = 0;
  const int half = protocol::HalfOfSeq(seq);
  // The tokens' plan entries for the combine (CarriedPlanArea), from the one round a CTA plans: written here, after the
  // loop, because inside it the stores made the kernel spill.
  if (warp == 1 && lane < K && my_tokens <= kWarps) {
    for (int tw = 0; tw < my_tokens; ++tw) KeepPlanEntry(c, half, blockIdx.x + tw * G, K, lane, sh->plan[tw]);
  }
  for (int d = G - 1 - static_cast<int>(blockIdx.x); d < R; d += G, ++k_dst) {
    if (tid == 0) PublishWhenDone(c, LlOp::kDispatch, half, d, static_cast<uint32_t>(sh->tokens_to_dst[k_dst]), seq);
  }
}

/// The lane's 4 scale_inv values of the 128-scale pass from g0: fp32 output order (g0 + 32 i + lane) or, for packed
/// UE8M0, the 4 groups of packed word g0 / 4 + lane (g0 + 4 lane + i). Missing groups read as 0.
__device__ __forceinline__ void LoadScalePass(const float* scales, int num_scales, int g0, bool ue8m0, float (&sc)[4]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int g = ue8m0 ? g0 + 4 * lane + i : g0 + 32 * i + lane;
    sc[i] = g < num_scales ? scales[g] : 0.0f;
  }
}

/// A message's place: its source and its index among that source's messages.
struct MessageRef {
  int src, j;
};

/// Messages counted over all sources (counts[src] each, -1 for a masked source: none). Warp-collective.
__device__ __forceinline__ int WarpMessageTotal(const int* counts, int R) {
  const int lane = threadIdx.x % 32;
  int total = 0;
  for (int s0 = 0; s0 < R; s0 += 32) total += gpu::WarpSum(s0 + lane < R ? max(counts[s0 + lane], 0) : 0);
  return total;
}

/// Message m (< WarpMessageTotal) of the messages taken in source order: a warp scan per 32 sources, so a warp
/// finds it without a CTA-wide scan and its barriers. Warp-collective, m warp-uniform.
__device__ __forceinline__ MessageRef LocateMessage(const int* counts, int R, int m) {
  const int lane = threadIdx.x % 32;
  int carry = 0;
  for (int s0 = 0; s0 < R; s0 += 32) {
    const int v = s0 + lane < R ? max(counts[s0 + lane], 0) : 0;
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
///  2. reads the route counts and builds the layout: local expert le's block holds the rows of source 0, then source
///     1, ... (begin[src][le] = the sum of cnt[src' < src][le]). The last CTA (tokenless at small T) also writes the
///     handle (recv_count, layout_range, statistics);
///  3. copies messages (one per (token, rank)) to their rows. A warp finds its message's source by a warp scan over
///     the message counts, not a CTA-wide scan (two barriers fewer on the way to the first copy).
/// Tried (bench/RESULTS.md session 17): each selection's lane reading only the counts it needs instead of the table
/// (a load that depends on the header: as slow as the table), and the first message's loads issued before the table
/// (held in registers or as L1 prefetches, the kernel spilled: 1.10-1.15x).
__device__ __forceinline__ void DispatchRecv(const DispatchParams& p, CallGate& gate, uint8_t* smem) {
  const LlDeviceContext& c = p.ctx;
  const protocol::LlLayout& L = c.layout;
  const int R = L.shape.num_ranks, E_loc = static_cast<int>(L.local_experts.divisor), H = L.shape.hidden;
  const int T = L.shape.max_tokens_per_rank, E = L.shape.num_experts;
  const int64_t rows = L.shape.max_recv_rows();
  const int num_scales = L.shape.num_scales();
  const int num_packed = L.shape.num_packed_ue8m0();
  const bool fp8 = p.mode.use_fp8;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, G = gridDim.x;
  const bool writes_handle = blockIdx.x == G - 1;
  // Shared: failed flag, msg_count[R] (messages per source, -1 masked), cnt[E] ([src][le]), begin[E] ([src][le]),
  // then the early route-count words [half][E] (DispatchRecvEarlyCounts).
  int* failed = reinterpret_cast<int*>(smem);
  int* msg_count = failed + 4;
  int* cnt = msg_count + R;
  int* begin = cnt + E;
  auto* early_words = reinterpret_cast<uint64_t*>(smem + DispatchRecvEarlyOffset(L.shape));
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
    early_words[tid] = early0;
    early_words[E + tid] = early1;
  }
  const uint32_t seq = gate.Open();  // its barrier also publishes *failed = 0, unless the gate was open already
  if (seq == 0) return;
  if (was_open) __syncthreads();
  const int half = protocol::HalfOfSeq(seq);
  WaitAllSources(c, LlOp::kDispatch, half, seq, T, p.wait_recv_cost_stats, msg_count, failed, peeked);
  __syncthreads();
  Trace(c, LlOp::kDispatch, kTraceSignals);
  StampWaitEnd(c, seq);
  if (*failed) return;

  // The layout table. A masked source (msg_count -1, rank masking) sends nothing: its route block is stale, not read.
  // A word still not tagged with the call after the source's signal is a stale or overwritten block: rejected.
  for (int i = tid; i < E; i += kThreads) {
    const int sr = L.local_experts.Div(i);
    uint32_t n = 0;
    if (msg_count[sr] >= 0) {
      uint64_t w = early ? early_words[half * E + i] : 0;
      if (protocol::RouteCountSeq(w) != seq) w = gpu::LoadRelaxedSys(count_word(half, i));
      n = protocol::RouteCountSeq(w) == seq ? protocol::RouteCountValue(w) : ~0u;
    }
    if (n > static_cast<uint32_t>(T)) failed[0] = 1 + sr;  // one source recorded, once, after the barrier
    cnt[i] = static_cast<int>(n);
  }
  __syncthreads();
  if (*failed) {
    if (tid == 0) RecordError(c, protocol::kDeviceBadMessage, LlOp::kDispatch, *failed - 1, seq, -1);
    return;
  }
  for (int le = tid; le < E_loc; le += kThreads) {
    int acc = 0;
    for (int sr = 0; sr < R; ++sr) {
      const int n = cnt[sr * E_loc + le];
      begin[sr * E_loc + le] = acc;
      if (writes_handle) p.layout_range[int64_t{le} * R + sr] = protocol::PackLayoutRange(n, acc);
      acc += n;
    }
    if (writes_handle) {
      p.recv_count[le] = acc;
      if (p.cumulative_local_expert_recv_stats != nullptr) atomicAdd(&p.cumulative_local_expert_recv_stats[le], acc);
      if (c.metrics != nullptr)
        AddMetric(c, c.metrics_layout.expert_recv_tokens(p.layer, le), static_cast<uint64_t>(acc));
    }
  }
  __syncthreads();
  Trace(c, LlOp::kDispatch, kTraceRecvPlanned);

  // A message (one per (token, rank)) carries up to top-k rows. When there are fewer messages than CTAs, several
  // CTAs copy one message: its payload's 512-byte slices (a 16-byte store per lane) split into `segs` segments, and
  // in FP8 mode one more item writes the scales. One warp storing all of a message's rows was the longest step of a
  // small-T receive (recv_trace at T=1: 2.9 us for the payload's 8 rows, then 1.4 us for their scales). Segments
  // target one item per CTA, not per warp: splitting down to a warp per slice at T=128 (1 rank) cost the dispatch
  // kernel 7 % (re-read headers, more warps fetching cold code), bench/RESULTS.md session 14.
  const int total = WarpMessageTotal(msg_count, R);
  const int64_t bytes = fp8 ? H : int64_t{2} * H;
  const int slices = static_cast<int>((bytes + 511) / 512);
  const int segs = total > 0 ? max(1, min(slices, G / total)) : 1;
  const int per_msg = segs + (fp8 ? 1 : 0);
  for (int item = warp * G + blockIdx.x; item < total * per_msg; item += G * kWarps) {
    const int m = item / per_msg, s = item - m * per_msg;
    const bool scale_item = s == segs;  // FP8: the message's item that writes the scales (no payload bytes)
    const int64_t lo = scale_item ? 0 : int64_t{s * slices / segs} * 512;
    const int64_t seg_bytes = scale_item ? 0 : min(bytes, int64_t{(s + 1) * slices / segs} * 512) - lo;
    const MessageRef ref = LocateMessage(msg_count, R, m);
    const int src = ref.src, j = ref.j;
    const uint8_t* in = SrcBase(c, src);
    const uint8_t* hdr = in + L.RouteHeaderOffset(L.RouteRecvOffset(half, src), j);
    const uint8_t* payload = in + L.DispatchRecvOffset(half, src, j, fp8);
    // The header, the segment's first pass and the first scales: independent loads, issued together.
    const uint32_t word = lane < 20 ? reinterpret_cast<const uint32_t*>(hdr)[lane] : 0u;
    uint4 v[kCopyRegs];
    LoadCopyPass(payload + lo, seg_bytes, 0, v);
    float sc[4];
    const float* scales = reinterpret_cast<const float*>(payload + protocol::Fp8ScalesOffset(H));
    if (scale_item) LoadScalePass(scales, num_scales, 0, p.mode.use_ue8m0, sc);
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
    int64_t my_row = -1, my_rr = 0;
    int my_le = 0;
    bool bad = false;
    if (lane < num_sel) {
      my_le = static_cast<int>(protocol::SelectionExpert(sel));
      const int r = static_cast<int>(protocol::SelectionRow(sel));
      bad = my_le >= E_loc || r >= cnt[src * E_loc + my_le];
      if (!bad) {
        my_rr = begin[src * E_loc + my_le] + r;  // row inside the local expert's packed block
        my_row = int64_t{my_le} * rows + my_rr;
        if (lead) p.src_info[my_row] = src_token;
      }
    }
    if (gpu::WarpAny(bad) && lane == 0 && lead) {
      RecordError(c, protocol::kDeviceBadMessage, LlOp::kDispatch, src, seq, j);
    }
    const unsigned targets = gpu::WarpBallot(my_row >= 0);
    // The segment goes through registers: loaded once per pass, stored to every selection's row.
    for (int64_t base = 0; base < seg_bytes; base += kCopyPassBytes) {
      if (base > 0) LoadCopyPass(payload + lo, seg_bytes, base, v);
      for (unsigned t = targets; t != 0; t &= t - 1) {
        const int64_t row = gpu::WarpShfl(my_row, __ffs(t) - 1);
        StoreCopyPass(static_cast<uint8_t*>(p.recv_x) + row * bytes + lo, seg_bytes, base, v);
      }
    }
    if (!scale_item) continue;
    // Scales, 128 per pass (4 per lane). fp32: [E_loc, H/128, R*T]; packed UE8M0: int32 [E_loc, H/512, R*T], byte
    // g % 4 of word (le, g / 4, row) is group g's exponent.
    for (int g0 = 0; g0 < num_scales; g0 += 128) {
      if (g0 > 0) LoadScalePass(scales, num_scales, g0, p.mode.use_ue8m0, sc);
      uint32_t packed = 0;
#pragma unroll
      for (int b = 0; b < 4 && p.mode.use_ue8m0; ++b) packed |= uint32_t{Ue8m0FromScaleInv(sc[b])} << (8 * b);
      for (unsigned t = targets; t != 0; t &= t - 1) {
        const int i_sel = __ffs(t) - 1;
        const int le = gpu::WarpShfl(my_le, i_sel);
        const int64_t rr = gpu::WarpShfl(my_rr, i_sel);
        if (p.mode.use_ue8m0) {
          const int q = g0 / 4 + lane;
          if (q < num_packed)
            static_cast<uint32_t*>(p.recv_scales)[(int64_t{le} * num_packed + q) * rows + rr] = packed;
        } else {
          float* out = static_cast<float*>(p.recv_scales) + int64_t{le} * num_scales * rows + rr;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int g = g0 + i * 32 + lane;
            if (g < num_scales) out[g * rows] = sc[i];
          }
        }
      }
    }
  }
  if (c.trace != nullptr) {
    __syncthreads();
    Trace(c, LlOp::kDispatch, kTraceRecvEnd);
  }
}

}  // namespace
}  // namespace llep::kernels::cuda
