// The dispatch send phase: route counts, token plans, encoded payload stores, completion, signals (DispatchSend).
// Part of the kernels' device code (ll_run_phases.cuh includes the parts into each translation unit that compiles
// kernels, kernels/cuda/ll_kernels*.cu; each part reopens the same private namespace): split by phase so a reader can
// hold each part.
#pragma once

#include "kernels/cuda/ll_call_gate.cuh"
#include "kernels/cuda/ll_routing.cuh"
#include "runtime/protocol/dispatch_msg.h"

namespace llep::kernels::cuda {
namespace {

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

  // Tokens of this CTA: b, b + G, ...; a round holds up to kWarps of them. With few tokens on an NVLink-only buffer
  // (T * P <= G, P = R rounded up to a power of two) each token is split by destination instead: CTA b takes token
  // b / P and stores only its message to rank b % P, so a token's copies leave from up to R SMs at once rather than
  // one after another from one (each copy plans the token: the plan is a function of topk_idx, all compute the same).
  // At EP4 T=1 the stores were done 0.6-1.1 us earlier, the hook send 8.4 -> 7.1 us (bench/RESULTS.md session 42;
  // kernels/SMALL_T_CODE.md rule 10). Not with proxy peers: their messages share one staged payload per token.
  const int lgp = CeilLog2(static_cast<uint32_t>(R));
  const bool split = !HasProxy(c) && R > 1 && (p.num_tokens << lgp) <= G;
  const int split_dst = split ? static_cast<int>(blockIdx.x) & ((1 << lgp) - 1) : -1;
  const int tok0 = split ? static_cast<int>(blockIdx.x) >> lgp : static_cast<int>(blockIdx.x), stride = split ? 0 : G;
  const int my_tokens = split ? (tok0 < p.num_tokens && split_dst < R ? 1 : 0)
                        : p.num_tokens > static_cast<int>(blockIdx.x)
                            ? static_cast<int>(c.grid.Div(p.num_tokens - blockIdx.x + G - 1))
                            : 0;
  // A counting CTA without tokens that counts one NVLink destination publishes its signal from the last warp's lane 0
  // (no prefix or metrics work there), which goes to the poll once the counts are stored while warp 0 keeps the route
  // prefix and the others add the metrics, instead of thread 0 reaching the poll after those and a CTA barrier. At T =
  // 1 the publisher read the full counter 0.9 us after both its counts and the token CTA's adds were done (recv_trace,
  // one rank: counted 3.78 us, the adds 3.78, polled 4.67; bench/RESULTS.md session 59).
  const int first_dst = FirstPublishedDst(G);
  const bool publish_in_count = my_tokens == 0 && first_dst < R && first_dst + G >= R &&
                                (!HasProxy(c) || c.peers[first_dst] != nullptr) && E_loc <= (kWarps - 1) * 32;
  constexpr int kCountPublisher = kThreads - 32;

  // Route-block counts first, one destination per CTA counted down from CTA G-2 (FirstPublishedDst; with T < G those
  // CTAs have no tokens, so counting overlaps the token work instead of following it).
  int k_dst = 0;
  for (int d = first_dst; d < R; d += G, ++k_dst) {
    for (int i = tid; i < E_loc; i += kThreads) counts[i] = 0;
    if (tid == 0) sh->tokens_to_dst[k_dst] = 0;
    __syncthreads();
    for (int t0 = 0; t0 < p.num_tokens; t0 += kThreads) {  // a thread per token: one round of loads
      const int t = t0 + tid;
      bool hit_any = false;
      if (t < p.num_tokens) {
        ForTokenIdsByEight(c, p.topk_idx, t, K, LlOp::kDispatch, seq, [&](const int(&ids)[8], int) {
#pragma unroll
          for (int k = 0; k < 8; ++k) {
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
    if (d == 0 && tid == 0) {
      StorePlanHeader(c.carried + CarriedPlanArea::header(half), p.num_tokens <= kWarps * G ? p.plan_key : 0, seq,
                      p.num_tokens, K);
    }
    uint8_t* const peer_d = c.peers[d];  // proxy peer (null): counts are staged in the route block sent at publish
    const bool d_via_proxy = HasProxy(c) && peer_d == nullptr;
    auto* remote_counts = reinterpret_cast<uint64_t*>(!d_via_proxy ? peer_d + L.RouteRecvOffset(half, c.rank)
                                                                   : c.proxy_region + L.RouteSendOffset(half, d));
    for (int i = tid; i < E_loc; i += kThreads) {
      gpu::StoreRelaxedSys(remote_counts + i, protocol::PackRouteCount(seq, static_cast<uint32_t>(counts[i])));
    }
    // publish_in_count: every thread's count stores before the signal's release (CTA barrier, cumulativity), and no
    // barrier after the prefix and the metrics (one destination: the counts are not reused).
    if (publish_in_count) __syncthreads();
    if (warp == 0) KeepRoutePrefix(c, half, d, counts, E_loc);
    if (c.metrics != nullptr) {  // selections sent to d: a warp reduction per 32 local experts
      for (int i0 = warp * 32; i0 < E_loc; i0 += kThreads) {
        const unsigned v = gpu::WarpSum(i0 + lane < E_loc ? static_cast<unsigned>(counts[i0 + lane]) : 0u);
        if (lane == 0 && v != 0) AddMetric(c, c.metrics_layout.sent_selections(d), v);
      }
    }
    if (!publish_in_count) __syncthreads();
    // The counts are ordered before d's signal, which this thread publishes: for an NVLink peer by that signal's
    // release store itself, for a proxy peer (the route block's write command is pushed before the signal) here.
    if (tid == 0 && d_via_proxy) FenceSys();
  }
  if (k_dst > 0) Trace(c, LlOp::kDispatch, kTraceCounted);

  for (int round = 0; round < my_tokens; round += kWarps) {
    const int n = min(kWarps, my_tokens - round);
    // Items: (token, chunk) payload pieces plus one header item per token (c.send_items = num_chunks + 1 of them). A
    // warp's first item of the round is loaded before the plan (it does not depend on it), so the x loads are in
    // flight with the routing loads.
    const auto item_token = [&](int item) {
      return tok0 + (round + static_cast<int>(c.send_items.Div(item))) * stride;
    };
    const bool first_is_payload = warp < n * (num_chunks + 1) && c.send_items.Mod(warp) < num_chunks;
    const ChunkPayload first =
        first_is_payload ? LoadChunk(p, item_token(warp), c.send_items.Mod(warp)) : ChunkPayload{};
    PlanRoundAnyK(c, p.topk_idx, tok0 + round * stride, stride, n, K, LlOp::kDispatch, seq, scratch, sh->plan,
                  split_dst);
    __syncthreads();
    if (round == 0) Trace(c, LlOp::kDispatch, kTracePlanned);
    if ((seq = gate.Open()) == 0) return;
    const int half = protocol::HalfOfSeq(seq);
    for (int item = warp; item < n * (num_chunks + 1); item += kWarps) {
      const int tw = c.send_items.Div(item), ch = item - tw * (num_chunks + 1);
      const TokenPlan& pl = sh->plan[tw];
      const int t = tok0 + (round + tw) * stride;
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
          const bool via_proxy = HasProxy(c) && base == nullptr;
          to_proxy |= via_proxy;
          if (via_proxy || !active) continue;
          store(base + L.DispatchRecvOffset(half, c.rank, pl.slot[k], fp8));
        }
        // Proxy destinations share one staged copy of the payload; each gets its own write command after the round.
        if (to_proxy && active) store(c.proxy_region + L.DispatchPayloadOffset(half, t, fp8));
      } else {
        // Header per destination: lane i < 5 writes bytes [16i, 16i + 16) of the 80-byte header; with
        // combine_weights, lanes 5-8 write the message's 64-byte weights row (ll_layout.h RouteWeightsOffset).
        // Lane l holds words 4l .. 4l + 3 of [header (20 words) | weights row (16)]: word 4 + s is the token's s-th
        // selection on rank d, in top-k order, word 20 + s its weight (registers only: no local array). Lane j < K
        // holds slot j (its rank, packed selection and weight), and a destination's words gather from those lanes:
        // a ballot, then per word its source lane (NthSetBit16) and two shuffles, all lanes at once, instead of a
        // loop over the K slots per destination (dependent shared-memory loads and selects: with it a T=1 token's
        // stores at EP4 were done 0.5 us later, bench/RESULTS.md session 41).
        const bool weights = p.carries_weights;
        const int dj = lane < K ? pl.dst[lane] : -1;
        const uint32_t vj = dj >= 0 ? protocol::PackSelection(pl.id[lane] - dj * E_loc, pl.row[lane]) : 0u;
        const uint32_t wj = weights && lane < K ? __float_as_uint(p.topk_weights[int64_t{t} * K + lane]) : 0u;
        for (unsigned m = pl.opens; m != 0; m &= m - 1) {
          const int k = __ffs(m) - 1, d = pl.dst[k];
          uint8_t* const base = PeerBase(c, lane_peer, d);
          const bool via_proxy = HasProxy(c) && base == nullptr;
          const unsigned on_d = gpu::WarpBallot(dj == d);  // bit j: slot j selects an expert on d
          const int num_sel = __popc(on_d);
          uint32_t words[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int wd = lane * 4 + i, s = wd < 20 ? wd - 4 : wd - 20;  // the selection word wd holds (wd >= 4)
            const bool holds = wd >= 4 && s < num_sel;
            const int from = NthSetBit16(on_d, holds ? s : 0);
            const uint32_t v = gpu::WarpShfl(vj, from), wv = gpu::WarpShfl(wj, from);
            words[i] = holds ? (wd < 20 ? v : wv) : 0u;
          }
          if (lane >= (weights ? 9 : 5)) continue;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int wd = lane * 4 + i;
            if (wd == 0) words[i] = static_cast<uint32_t>(t);
            if (wd == 1) words[i] = static_cast<uint32_t>(num_sel) | (protocol::kDispatchMsgVersion << 16);
            if (wd == 2) words[i] = seq;
            if (wd == 3) words[i] = (fp8 ? protocol::kMsgFlagFp8 : 0u) | (weights ? protocol::kMsgFlagWeights : 0u);
          }
          const int64_t block = !via_proxy ? L.RouteRecvOffset(half, c.rank) : L.RouteSendOffset(half, d);
          uint8_t* const at = (!via_proxy ? base : c.proxy_region) +
                              (lane < 5 ? L.RouteHeaderOffset(block, pl.slot[k]) + lane * 16
                                        : L.RouteWeightsOffset(block, pl.slot[k]) + (lane - 5) * 16);
          St16(at, make_uint4(words[0], words[1], words[2], words[3]));
        }
      }
    }
    __syncthreads();
    Trace(c, LlOp::kDispatch, kTraceStored);
    if (warp == 0) {
      // Lane i < n owns the round's token i (n <= kWarps <= 32). One increment per (token, destination) message,
      // after a fence that follows the CTA barrier (FenceBeforeCount; with proxy peers a system-scope one, which also
      // orders the staged payloads before their commands).
      const bool mine = lane < n;
      if (mine) FenceBeforeCount(HasProxy(c));
      if (round == 0) Trace(c, LlOp::kDispatch, kTraceFenced);
      const TokenPlan& pl = sh->plan[mine ? lane : 0];
      const int t = tok0 + (round + lane) * stride;
      const unsigned opens = mine ? pl.opens : 0u;
      if (HasProxy(c)) {
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
  // Split by destination: the token's first CTA keeps it.
  if (warp == 1 && lane < K && my_tokens <= kWarps && split_dst <= 0) {
    for (int tw = 0; tw < my_tokens; ++tw) {
      KeepPlanEntry(c, half, tok0 + tw * stride, K, lane, sh->plan[tw], p.topk_weights);
    }
  }
  // The publishing thread's loop (the compiler still computes its trip count with one division).
  if (tid == (publish_in_count ? kCountPublisher : 0)) {
    k_dst = 0;
    for (int d = first_dst; d < R; d += G, ++k_dst) {
      const auto n = static_cast<uint32_t>(sh->tokens_to_dst[k_dst]);
      PublishWhenDone(c, LlOp::kDispatch, half, d, n, seq, n, p.carries_weights);
    }
  }
}

}  // namespace
}  // namespace llep::kernels::cuda
