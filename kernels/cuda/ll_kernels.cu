// The NVLink dispatch and combine kernels (see ll_kernels.h for the contract).
//
// Work split (G CTAs of 16 warps; every CTA resident):
//  dispatch send   CTA b owns tokens b, b+G, ... in rounds of up to 16. Per round each warp plans one token
//                  (its top-k ids, row in each (expert, source) block and message slot per destination, by a
//                  scan of earlier tokens: the deterministic plan of kernels/host/route_plan.h), then all warps
//                  encode 512-channel chunks once and store them to every destination of the token. After the
//                  round a fence and one counter increment per (token, destination). Before its tokens, CTA
//                  G-1-d (strided, so the CTAs without tokens when T < G) counts the tokens per local expert
//                  for destination d and writes that route-block prefix (+1 on the counter); after them it
//                  waits for the counter to reach messages + 1 and publishes the signal word.
//  dispatch recv   every CTA waits for all R signals, reads the route-block counts and computes the packed
//                  layout (blocks in source order); warps take messages (one per warp) and fan each payload out
//                  to its rows. CTA 0 writes recv_count, layout_range and the statistics.
//  combine send    every CTA reads layout_range and computes, per (local expert, home rank), the position of the
//                  block in the home rank's receive area; warps copy one row each (flattened over all blocks),
//                  then a counter per home rank and a signal as in dispatch.
//  combine recv    every CTA waits for all signals, recomputes the plan of its own tokens (positions from the
//                  per-expert counts and the scan) and reduces top-k rows in fp32 fma order, 256 channels per
//                  warp item, exactly as the CPU backend does.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/codec/fp8.h"
#include "kernels/cuda/ll_kernels.h"
#include "runtime/protocol/dispatch_msg.h"
#include "runtime/protocol/signal.h"
#include "runtime/protocol/sys_order.h"

namespace llep::kernels::cuda {
namespace {

using protocol::LlOp;

constexpr int kWarps = 16;
constexpr int kThreads = kWarps * 32;
constexpr int kK = protocol::kMaxTopK;
constexpr int kChunk = 512;  // channels per dispatch work item: 16 per lane
constexpr unsigned kFull = 0xFFFFFFFFu;

// ------------------------------------------------------------------------------------------ memory model

// Signal words: protocol::LoadAcquireSys / StoreReleaseSys (runtime/protocol/sys_order.h).
__device__ __forceinline__ uint32_t LdAcquireGpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void FenceSys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ uint64_t NowNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint4 Ld16(const void* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ void St16(void* p, const uint4& v) { *reinterpret_cast<uint4*>(p) = v; }

// ------------------------------------------------------------------------------------------ errors

__device__ void RecordError(const LlDeviceContext& c, uint32_t code, LlOp op, int peer, uint32_t seq, int64_t detail) {
  const bool fatal = code == kGpuTimeout || code == kGpuSequenceOverrun || code == kGpuBadMessage;
  if (fatal) atomicExch(&c.flags[1], 1u);
  if (atomicCAS(&c.flags[0], 0u, 1u) != 0u) return;  // the first error keeps the record
  volatile GpuErrorInfo* e = c.error;
  e->op = static_cast<uint32_t>(op);
  e->peer = peer;
  e->seq = seq;
  e->detail = detail;
  __threadfence_system();
  e->code = code;
  __threadfence_system();
}

__device__ __forceinline__ bool Aborted(const LlDeviceContext& c) {
  return *reinterpret_cast<volatile const uint32_t*>(&c.flags[1]) != 0u;
}

/// Waits for `p` to carry call `seq`; returns its value, or -1 after recording a timeout / overrun (or when
/// another CTA already aborted). `waited` receives the time spent.
__device__ int64_t WaitSignal(const LlDeviceContext& c, const uint64_t* p, LlOp op, int src, uint32_t seq,
                              int64_t* waited) {
  const uint64_t t0 = NowNs();
  for (uint32_t spin = 0;; ++spin) {
    const uint64_t w = protocol::LoadAcquireSys(p);
    const uint32_t s = protocol::SignalSeq(w);
    if (s == seq) {
      *waited = static_cast<int64_t>(NowNs() - t0);
      return protocol::SignalValue(w);
    }
    if (protocol::SignalIsNewer(s, seq)) {
      RecordError(c, kGpuSequenceOverrun, op, src, seq, s);
      return -1;
    }
    if ((spin & 255u) == 255u) {
      if (Aborted(c)) return -1;
      if (NowNs() - t0 > c.timeout_ns) {
        RecordError(c, kGpuTimeout, op, src, seq, static_cast<int64_t>(c.timeout_ns));
        return -1;
      }
    }
  }
}

/// The receive phases' wait: the CTA's threads wait for every source's signal of call `seq`, store each value
/// (0 on failure) in values[src], set *failed on a timeout, overrun or a value above max_value (recorded), and
/// CTA 0 adds the waiting time to wait_stats[src] (ns). The caller synchronises the CTA before reading values.
__device__ void WaitAllSources(const LlDeviceContext& c, LlOp op, int half, uint32_t seq, int64_t max_value,
                               int64_t* wait_stats, int* values, int* failed) {
  for (int src = threadIdx.x; src < c.layout.shape.num_ranks; src += kThreads) {
    int64_t waited = 0;
    const int64_t v =
        WaitSignal(c, reinterpret_cast<const uint64_t*>(c.peers[c.rank] + c.layout.SignalOffset(half, op, src)), op,
                   src, seq, &waited);
    if (v > max_value) RecordError(c, kGpuBadMessage, op, src, seq, v);
    const bool ok = v >= 0 && v <= max_value;
    if (!ok) *failed = 1;
    values[src] = ok ? static_cast<int>(v) : 0;
    if (blockIdx.x == 0 && wait_stats != nullptr) {
      atomicAdd(reinterpret_cast<unsigned long long*>(&wait_stats[src]), static_cast<unsigned long long>(waited));
    }
  }
}

/// Waits until every message of this launch to `dst` is stored, then publishes the signal word there.
__device__ void PublishWhenDone(const LlDeviceContext& c, LlOp op, int half, int dst, uint32_t expected, uint32_t seq,
                                uint32_t value) {
  uint32_t* done = c.done + (half * protocol::kNumLlOps + static_cast<int>(op)) * c.layout.shape.num_ranks + dst;
  const uint64_t t0 = NowNs();
  for (uint32_t spin = 0; LdAcquireGpu(done) != expected; ++spin) {
    if ((spin & 255u) == 255u && (Aborted(c) || NowNs() - t0 > c.timeout_ns)) {
      RecordError(c, kGpuTimeout, op, c.rank, seq, -1);  // local: a CTA of this launch never finished
      return;
    }
  }
  *done = 0;  // stream order makes the next launch of this (half, op) see zero
  protocol::StoreReleaseSys(reinterpret_cast<uint64_t*>(c.peers[dst] + c.layout.SignalOffset(half, op, c.rank)),
                            protocol::PackSignal(seq, value));
}

__device__ __forceinline__ void CountDone(const LlDeviceContext& c, LlOp op, int half, int dst) {
  atomicAdd(c.done + (half * protocol::kNumLlOps + static_cast<int>(op)) * c.layout.shape.num_ranks + dst, 1u);
}

// ------------------------------------------------------------------------------------------ routing

/// topk_idx[t][lane] as a validated expert id, for the calling warp (lanes >= K get -1): -1 for "no expert", for
/// an id outside [-1, E) (recorded) and for an id an earlier slot of the same token already selected (recorded).
/// Every phase uses this, so a bad row is treated identically everywhere and the buffer stays consistent. One
/// coalesced load per token; the duplicate check runs on shuffles (trace on H200: the per-slot scalar loads it
/// replaces cost 3.6 us per token plan and 7.6 us per 1024-entry histogram).
__device__ int WarpTokenExpert(const LlDeviceContext& c, const int64_t* topk, int t, int K, LlOp op, uint32_t seq) {
  const int lane = threadIdx.x % 32, E = c.layout.shape.num_experts;
  const int64_t v = lane < K ? topk[static_cast<int64_t>(t) * K + lane] : -1;
  const bool in_range = v >= -1 && v < E;
  if (!in_range) RecordError(c, kGpuBadExpertId, op, -1, seq, v);
  const int id = in_range ? static_cast<int>(v) : -1;
  bool dup = false;
  for (int j = 0; j < K - 1; ++j) {
    const int other = __shfl_sync(kFull, id, j);
    dup |= j < lane && id >= 0 && other == id;
  }
  if (dup) RecordError(c, kGpuBadExpertId, op, -1, seq, v);
  return dup ? -1 : id;
}

/// The plan of one token, written by one warp into shared memory.
struct TokenPlan {
  int id[kK];    ///< validated expert id per slot, -1 = skipped
  int row[kK];   ///< row_in_block: earlier tokens that select the same expert
  int slot[kK];  ///< message slot of this token on the slot's destination rank
};

/// True when slot k is the token's first selection on its rank: the slot that owns the (token, rank) message.
__device__ __forceinline__ bool OpensMessage(const TokenPlan& pl, int k, int E_loc) {
  if (pl.id[k] < 0) return false;
  const int d = pl.id[k] / E_loc;
  for (int j = 0; j < k; ++j) {
    if (pl.id[j] >= 0 && pl.id[j] / E_loc == d) return false;
  }
  return true;
}

/// One warp computes the plan of token t (route_plan.h definitions) by scanning tokens t' < t, 32 at a time.
template <int kMaxK>
__device__ void PlanToken(const LlDeviceContext& c, const int64_t* topk, int t, int K, LlOp op, uint32_t seq,
                          TokenPlan* out) {
  const int lane = threadIdx.x % 32, E_loc = c.layout.shape.num_local_experts();
  const int E = c.layout.shape.num_experts;
  int ids[kMaxK], dst[kMaxK], row[kMaxK], slot[kMaxK];
  const int my_id = WarpTokenExpert(c, topk, t, K, op, seq);
#pragma unroll
  for (int k = 0; k < kMaxK; ++k) {
    ids[k] = __shfl_sync(kFull, my_id, k);
    dst[k] = ids[k] >= 0 ? ids[k] / E_loc : -1;
    row[k] = 0;
    slot[k] = 0;
  }
  for (int tp = lane; tp < t; tp += 32) {
    int q[kMaxK], qd[kMaxK];
    const int64_t* r = topk + static_cast<int64_t>(tp) * K;
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) {
      const int64_t v = j < K ? r[j] : -1;
      q[j] = (v >= 0 && v < E) ? static_cast<int>(v) : -1;
      qd[j] = q[j] >= 0 ? q[j] / E_loc : -2;
    }
#pragma unroll
    for (int k = 0; k < kMaxK; ++k) {
      bool same_expert = false, same_rank = false;
#pragma unroll
      for (int j = 0; j < kMaxK; ++j) {
        same_expert |= q[j] == ids[k];
        same_rank |= qd[j] == dst[k];
      }
      row[k] += (same_expert && ids[k] >= 0) ? 1 : 0;
      slot[k] += same_rank ? 1 : 0;
    }
  }
#pragma unroll
  for (int k = 0; k < kMaxK; ++k) {
    row[k] = __reduce_add_sync(kFull, row[k]);
    slot[k] = __reduce_add_sync(kFull, slot[k]);
  }
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < kK; ++k) {
      out->id[k] = k < kMaxK ? ids[k] : -1;
      out->row[k] = k < kMaxK ? row[k] : 0;
      out->slot[k] = k < kMaxK ? slot[k] : 0;
    }
  }
}

__device__ void PlanTokenAnyK(const LlDeviceContext& c, const int64_t* topk, int t, int K, LlOp op, uint32_t seq,
                              TokenPlan* out) {
  if (K <= 8) {
    PlanToken<8>(c, topk, t, K, op, seq, out);
  } else {
    PlanToken<kK>(c, topk, t, K, op, seq, out);
  }
}

/// In-place exclusive prefix sum of a[0..n) in shared memory by the whole CTA; returns the total.
__device__ int BlockExclusiveScan(int* a, int n, int* warp_sums) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int per = (n + kThreads - 1) / kThreads;
  const int lo = min(n, tid * per), hi = min(n, lo + per);
  int s = 0;
  for (int i = lo; i < hi; ++i) s += a[i];
  int x = s;
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFull, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < kWarps ? warp_sums[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(kFull, w, o);
      if (lane >= o) w += y;
    }
    if (lane < kWarps) warp_sums[lane] = w;
  }
  __syncthreads();
  int base = (warp > 0 ? warp_sums[warp - 1] : 0) + x - s;
  for (int i = lo; i < hi; ++i) {
    const int v = a[i];
    a[i] = base;
    base += v;
  }
  const int total = warp_sums[kWarps - 1];
  __syncthreads();
  return total;
}

/// Last index q in [0, n) with starts[q] <= m (starts non-decreasing, starts[0] == 0): the non-empty block
/// that holds flattened item m.
__device__ __forceinline__ int FindBlock(const int* starts, int n, int m) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= m) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// ------------------------------------------------------------------------------------------ FP8

/// Encodes 16 channels per lane (8 lanes per 128-channel group); returns the 16 e4m3 codes and the group's
/// scale_inv. Arithmetic is kernels/codec/fp8.h's; the conversion is cvt.rn.satfinite (bit-equal to
/// FloatToE4m3, checked by encode_payload_test).
__device__ __forceinline__ uint4 EncodeFp8x16(const uint4& a, const uint4& b, bool round_scale, float* scale_inv) {
  float v[16];
  const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[2 * i] = BitsToFloat(w[i] << 16);
    v[2 * i + 1] = BitsToFloat(w[i] & 0xFFFF0000u);
  }
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
  for (int m = 4; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, m));
  const Fp8Scale s = ComputeFp8Scale(amax, round_scale);
  *scale_inv = s.scale_inv;
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_fp8x2_storage_t lo =
        __nv_cvt_float2_to_fp8x2(make_float2(v[4 * i] * s.scale, v[4 * i + 1] * s.scale), __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
        make_float2(v[4 * i + 2] * s.scale, v[4 * i + 3] * s.scale), __NV_SATFINITE, __NV_E4M3);
    out[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// ------------------------------------------------------------------------------------------ dispatch

// Destinations one CTA counts and signals: ceil(R / G); the host launches enough CTAs to stay within it.
constexpr int kMaxDstPerCta = kMaxDestinationsPerCta;

struct DispatchSendShared {
  TokenPlan plan[kWarps];
  int tokens_to_dst[kMaxDstPerCta];
};

__device__ void DispatchSend(const DispatchParams& p, uint8_t* smem) {
  const LlDeviceContext& c = p.ctx;
  const protocol::LlLayout& L = c.layout;
  const int R = L.shape.num_ranks, E_loc = L.shape.num_local_experts(), H = L.shape.hidden;
  const int K = p.num_topk, half = protocol::HalfOfSeq(p.seq);
  const bool fp8 = p.mode.use_fp8;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, G = gridDim.x;
  auto* sh = reinterpret_cast<DispatchSendShared*>(smem);
  int* counts = reinterpret_cast<int*>(smem + sizeof(DispatchSendShared));
  const int num_chunks = (H + kChunk - 1) / kChunk;

  // Route-block counts first, one destination per CTA counted from the last CTA (with T < G those CTAs have no
  // tokens, so counting overlaps the token work instead of following it).
  int k_dst = 0;
  for (int d = G - 1 - static_cast<int>(blockIdx.x); d < R; d += G, ++k_dst) {
    for (int i = tid; i < E_loc; i += kThreads) counts[i] = 0;
    if (tid == 0) sh->tokens_to_dst[k_dst] = 0;
    __syncthreads();
    for (int t = warp; t < p.num_tokens; t += kWarps) {
      const int g = WarpTokenExpert(c, p.topk_idx, t, K, LlOp::kDispatch, p.seq);
      const bool hit = g >= 0 && g / E_loc == d;
      if (hit) atomicAdd(&counts[g % E_loc], 1);
      if (__any_sync(kFull, hit) && lane == 0) atomicAdd(&sh->tokens_to_dst[k_dst], 1);
    }
    __syncthreads();
    auto* remote_counts = reinterpret_cast<uint32_t*>(c.peers[d] + L.RouteRecvOffset(half, c.rank));
    for (int i = tid; i < E_loc; i += kThreads) remote_counts[i] = static_cast<uint32_t>(counts[i]);
    __syncthreads();
    if (tid == 0) {
      FenceSys();
      CountDone(c, LlOp::kDispatch, half, d);
    }
  }

  // Tokens of this CTA: b, b + G, ...; a round holds up to kWarps of them.
  const int my_tokens = p.num_tokens > static_cast<int>(blockIdx.x) ? (p.num_tokens - blockIdx.x + G - 1) / G : 0;
  for (int round = 0; round < my_tokens; round += kWarps) {
    const int n = min(kWarps, my_tokens - round);
    if (warp < n)
      PlanTokenAnyK(c, p.topk_idx, blockIdx.x + (round + warp) * G, K, LlOp::kDispatch, p.seq, &sh->plan[warp]);
    __syncthreads();
    // Items: (token, chunk) payload pieces plus one header item per token.
    for (int item = warp; item < n * (num_chunks + 1); item += kWarps) {
      const int tw = item / (num_chunks + 1), ch = item % (num_chunks + 1);
      const TokenPlan& pl = sh->plan[tw];
      const int t = blockIdx.x + (round + tw) * G;
      if (ch < num_chunks) {
        const int c0 = ch * kChunk + lane * 16;
        const bool active = c0 < H;
        const uint16_t* xr = p.x + static_cast<int64_t>(t) * H;
        const uint4 a = active ? Ld16(xr + c0) : make_uint4(0, 0, 0, 0);
        const uint4 b = active ? Ld16(xr + c0 + 8) : make_uint4(0, 0, 0, 0);
        uint4 code{};
        float scale_inv = 0.0f;
        if (fp8) code = EncodeFp8x16(a, b, p.mode.round_scale, &scale_inv);
        for (int k = 0; k < K; ++k) {
          if (!OpensMessage(pl, k, E_loc)) continue;
          const int d = pl.id[k] / E_loc;
          uint8_t* dstp = c.peers[d] + L.DispatchRecvOffset(half, c.rank, pl.slot[k], fp8);
          if (!active) continue;
          if (fp8) {
            St16(dstp + c0, code);
            if (lane % 8 == 0) reinterpret_cast<float*>(dstp + protocol::Fp8ScalesOffset(H))[c0 / 128] = scale_inv;
          } else {
            St16(dstp + int64_t{c0} * 2, a);
            St16(dstp + int64_t{c0} * 2 + 16, b);
          }
        }
      } else {
        // Header per destination: lane i writes bytes [16i, 16i + 16) of the 80-byte header.
        for (int k = 0; k < K; ++k) {
          if (!OpensMessage(pl, k, E_loc) || lane >= 5) continue;
          const int d = pl.id[k] / E_loc;
          uint32_t words[4];
          int num_sel = 0;
          uint32_t sel[kK];
          for (int j = 0; j < K; ++j) {
            if (pl.id[j] >= 0 && pl.id[j] / E_loc == d)
              sel[num_sel++] = protocol::PackSelection(pl.id[j] % E_loc, pl.row[j]);
          }
          for (int i = 0; i < 4; ++i) {
            const int wd = lane * 4 + i;
            uint32_t v = 0;
            if (wd == 0) v = static_cast<uint32_t>(t);
            if (wd == 1) v = static_cast<uint32_t>(num_sel) | (protocol::kDispatchMsgVersion << 16);
            if (wd == 2) v = p.seq;
            if (wd == 3) v = fp8 ? protocol::kMsgFlagFp8 : 0u;
            if (wd >= 4 && wd - 4 < num_sel) v = sel[wd - 4];
            words[i] = v;
          }
          uint8_t* hdr = c.peers[d] + L.RouteHeaderOffset(L.RouteRecvOffset(half, c.rank), pl.slot[k]);
          St16(hdr + lane * 16, make_uint4(words[0], words[1], words[2], words[3]));
        }
      }
    }
    __syncthreads();
    if (tid < n) {
      // One increment per (token, destination) message, after a system fence that follows the CTA barrier.
      FenceSys();
      const TokenPlan& pl = sh->plan[tid];
      for (int k = 0; k < K; ++k) {
        if (OpensMessage(pl, k, E_loc)) CountDone(c, LlOp::kDispatch, half, pl.id[k] / E_loc);
      }
    }
    __syncthreads();
  }

  // The signal of each counted destination once all its messages (and the counts) are stored.
  k_dst = 0;
  for (int d = G - 1 - static_cast<int>(blockIdx.x); d < R; d += G, ++k_dst) {
    if (tid == 0) {
      const uint32_t n = static_cast<uint32_t>(sh->tokens_to_dst[k_dst]);
      PublishWhenDone(c, LlOp::kDispatch, half, d, n + 1, p.seq, n);
    }
  }
}

__device__ void DispatchRecv(const DispatchParams& p, uint8_t* smem) {
  const LlDeviceContext& c = p.ctx;
  const protocol::LlLayout& L = c.layout;
  const int R = L.shape.num_ranks, E_loc = L.shape.num_local_experts(), H = L.shape.hidden;
  const int T = L.shape.max_tokens_per_rank, E = L.shape.num_experts;
  const int64_t rows = L.shape.max_recv_rows();
  const int half = protocol::HalfOfSeq(p.seq), num_scales = L.shape.num_scales();
  const int num_packed = L.shape.num_packed_ue8m0();
  const bool fp8 = p.mode.use_fp8;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, G = gridDim.x;
  // Shared: failed flag, warp sums, msg_start[R + 1], cnt[E] ([src][le]), begin[E] ([src][le]).
  int* failed = reinterpret_cast<int*>(smem);
  int* warp_sums = failed + 4;
  int* msg_start = warp_sums + kWarps;
  int* cnt = msg_start + R + 1;
  int* begin = cnt + E;

  if (tid == 0) *failed = 0;
  __syncthreads();
  WaitAllSources(c, LlOp::kDispatch, half, p.seq, T, p.wait_stats, msg_start, failed);  // messages per source
  __syncthreads();
  if (*failed) return;
  for (int i = tid; i < E; i += kThreads) {
    const int src = i / E_loc, le = i % E_loc;
    const uint32_t v = reinterpret_cast<const uint32_t*>(c.peers[c.rank] + L.RouteRecvOffset(half, src))[le];
    if (v > static_cast<uint32_t>(T)) {
      RecordError(c, kGpuBadMessage, LlOp::kDispatch, src, p.seq, -1);
      *failed = 1;
    }
    cnt[i] = static_cast<int>(v);
  }
  __syncthreads();
  if (*failed) return;
  // Blocks of one local expert are ordered by source: begin[src][le] = sum over src' < src of cnt[src'][le].
  for (int le = tid; le < E_loc; le += kThreads) {
    int acc = 0;
    for (int src = 0; src < R; ++src) {
      const int v = cnt[src * E_loc + le];
      begin[src * E_loc + le] = acc;
      if (blockIdx.x == 0) p.layout_range[int64_t{le} * R + src] = static_cast<int64_t>(v) | (int64_t{acc} << 32);
      acc += v;
    }
    if (blockIdx.x == 0) {
      p.recv_count[le] = acc;
      if (p.cumulative_stats != nullptr) atomicAdd(&p.cumulative_stats[le], acc);
    }
  }
  if (tid == 0) msg_start[R] = 0;
  __syncthreads();
  const int total = BlockExclusiveScan(msg_start, R + 1, warp_sums);

  for (int m = warp * G + blockIdx.x; m < total; m += G * kWarps) {
    const int src = FindBlock(msg_start, R, m), j = m - msg_start[src];
    const uint8_t* hdr = c.peers[c.rank] + L.RouteHeaderOffset(L.RouteRecvOffset(half, src), j);
    const uint32_t word = lane < 20 ? reinterpret_cast<const uint32_t*>(hdr)[lane] : 0u;
    const int src_token = static_cast<int>(__shfl_sync(kFull, word, 0));
    const uint32_t w1 = __shfl_sync(kFull, word, 1);
    const int num_sel = static_cast<int>(w1 & 0xFFFF);
    const bool ok = (w1 >> 16) == protocol::kDispatchMsgVersion && __shfl_sync(kFull, word, 2) == p.seq &&
                    ((__shfl_sync(kFull, word, 3) & protocol::kMsgFlagFp8) != 0) == fp8 && num_sel >= 1 &&
                    num_sel <= kK && src_token >= 0 && src_token < T;
    if (!ok) {
      if (lane == 0) RecordError(c, kGpuBadMessage, LlOp::kDispatch, src, p.seq, j);
      continue;
    }
    const uint8_t* payload = c.peers[c.rank] + L.DispatchRecvOffset(half, src, j, fp8);
    for (int i = 0; i < num_sel; ++i) {
      const uint32_t sel = __shfl_sync(kFull, word, (4 + i) & 31);
      const int le = static_cast<int>(protocol::SelectionExpert(sel)),
                r = static_cast<int>(protocol::SelectionRow(sel));
      if (le >= E_loc || r >= cnt[src * E_loc + le]) {
        if (lane == 0) RecordError(c, kGpuBadMessage, LlOp::kDispatch, src, p.seq, j);
        continue;
      }
      const int64_t rr = begin[src * E_loc + le] + r;  // row inside the local expert's packed block
      const int64_t row = int64_t{le} * rows + rr;
      if (lane == 0) p.src_info[row] = src_token;
      if (fp8) {
        uint8_t* out = static_cast<uint8_t*>(p.recv_x) + row * H;
        for (int c0 = lane * 16; c0 < H; c0 += 32 * 16) St16(out + c0, Ld16(payload + c0));
        const float* scales = reinterpret_cast<const float*>(payload + protocol::Fp8ScalesOffset(H));
        if (p.mode.use_ue8m0) {
          // int32 [E_loc, H/512, R*T]: byte g % 4 of word (le, g / 4, row) is group g's exponent.
          for (int q = lane; q < num_packed; q += 32) {
            uint32_t packed = 0;
            for (int b = 0; b < 4; ++b) packed |= uint32_t{Ue8m0FromScaleInv(scales[q * 4 + b])} << (8 * b);
            static_cast<uint32_t*>(p.recv_scales)[(int64_t{le} * num_packed + q) * rows + rr] = packed;
          }
        } else {
          for (int g = lane; g < num_scales; g += 32) {
            static_cast<float*>(p.recv_scales)[(int64_t{le} * num_scales + g) * rows + rr] = scales[g];
          }
        }
      } else {
        uint8_t* out = static_cast<uint8_t*>(p.recv_x) + row * H * 2;
        for (int c0 = lane * 16; c0 < 2 * H; c0 += 32 * 16) St16(out + c0, Ld16(payload + c0));
      }
    }
  }
}

// ------------------------------------------------------------------------------------------ combine

__device__ void CombineSend(const CombineParams& p, uint8_t* smem) {
  const LlDeviceContext& c = p.ctx;
  const protocol::LlLayout& L = c.layout;
  const int R = L.shape.num_ranks, E_loc = L.shape.num_local_experts(), H = L.shape.hidden;
  const int T = L.shape.max_tokens_per_rank, E = L.shape.num_experts;
  const int64_t rows = L.shape.max_recv_rows(), row_bytes = protocol::CombineRowBytes(H);
  const int half = protocol::HalfOfSeq(p.seq);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, G = gridDim.x;
  // Shared, indexed q = le * R + d: count, begin (row in the expert's packed block), pos (row in the home rank's
  // receive area), item start (flattened rows); rows_to[d].
  int* warp_sums = reinterpret_cast<int*>(smem);
  int* cnt = warp_sums + kWarps;
  int* beg = cnt + E;
  int* pos = beg + E;
  int* start = pos + E;
  int* rows_to = start + E;

  for (int q = tid; q < E; q += kThreads) {
    const int64_t v = p.layout_range[q];
    const int64_t n = v & 0xFFFFFFFF, b = v >> 32;
    const bool ok = n <= T && b >= 0 && b + n <= rows;
    if (!ok) RecordError(c, kGpuBadLayoutRange, LlOp::kCombine, q % R, p.seq, q);
    cnt[q] = ok ? static_cast<int>(n) : 0;
    beg[q] = ok ? static_cast<int>(b) : 0;
  }
  __syncthreads();
  for (int d = tid; d < R; d += kThreads) {
    int acc = 0;
    for (int le = 0; le < E_loc; ++le) {
      pos[le * R + d] = acc;
      acc += cnt[le * R + d];
    }
    if (acc > L.combine_rows_per_src) {  // more rows than the home rank's receive area holds: send none
      RecordError(c, kGpuBadLayoutRange, LlOp::kCombine, d, p.seq, acc);
      for (int le = 0; le < E_loc; ++le) cnt[le * R + d] = 0;
      acc = 0;
    }
    rows_to[d] = acc;
  }
  __syncthreads();
  for (int q = tid; q < E; q += kThreads) start[q] = cnt[q];
  __syncthreads();
  const int total = BlockExclusiveScan(start, E, warp_sums);

  for (int m = warp * G + blockIdx.x; m < total; m += G * kWarps) {
    const int q = FindBlock(start, E, m), le = q / R, d = q % R, i = m - start[q];
    const int64_t src_row = beg[q] + i;
    const uint8_t* src = p.x != nullptr ? reinterpret_cast<const uint8_t*>(p.x + (int64_t{le} * rows + src_row) * H)
                                        : c.peers[c.rank] + L.CombineSendOffset(half, le, src_row);
    uint8_t* dst = c.peers[d] + L.CombineRecvOffset(half, c.rank, pos[q] + i);
    int64_t off = lane * 16;
    for (; off + 3 * 512 < row_bytes; off += 4 * 512) {
      const uint4 v0 = Ld16(src + off), v1 = Ld16(src + off + 512), v2 = Ld16(src + off + 1024),
                  v3 = Ld16(src + off + 1536);
      St16(dst + off, v0);
      St16(dst + off + 512, v1);
      St16(dst + off + 1024, v2);
      St16(dst + off + 1536, v3);
    }
    for (; off < row_bytes; off += 512) St16(dst + off, Ld16(src + off));
    __syncwarp();
    if (lane == 0) {
      FenceSys();
      CountDone(c, LlOp::kCombine, half, d);
    }
  }
  __syncthreads();
  for (int d = blockIdx.x; d < R; d += G) {
    if (tid == 0) PublishWhenDone(c, LlOp::kCombine, half, d, rows_to[d], p.seq, rows_to[d]);
  }
}

struct CombineRecvPlan {
  int64_t row_off[kK];  ///< byte offset of the returned row in the local region, -1 = skipped slot
  float weight[kK];
};

__device__ void CombineRecv(const CombineParams& p, uint8_t* smem) {
  const LlDeviceContext& c = p.ctx;
  const protocol::LlLayout& L = c.layout;
  const int R = L.shape.num_ranks, E_loc = L.shape.num_local_experts(), H = L.shape.hidden;
  const int E = L.shape.num_experts, K = p.num_topk;
  const int half = protocol::HalfOfSeq(p.seq);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, G = gridDim.x;
  // Shared: failed, warp sums, got[R] (rows each source announced), expert counts -> exclusive prefix [E],
  // token plans, per-round row plans.
  int* failed = reinterpret_cast<int*>(smem);
  int* warp_sums = failed + 4;
  int* got = warp_sums + kWarps;
  int* prefix = got + R;
  auto* plans = reinterpret_cast<TokenPlan*>(smem + protocol::AlignUp(int64_t{4} * (4 + kWarps + R + E), 16));
  auto* rplans = reinterpret_cast<CombineRecvPlan*>(plans + kWarps);

  if (tid == 0) *failed = 0;
  for (int g = tid; g < E; g += kThreads) prefix[g] = 0;
  __syncthreads();
  WaitAllSources(c, LlOp::kCombine, half, p.seq, L.combine_rows_per_src, p.wait_stats, got, failed);  // rows
  for (int t = warp; t < p.num_tokens; t += kWarps) {
    const int g = WarpTokenExpert(c, p.topk_idx, t, K, LlOp::kCombine, p.seq);
    if (g >= 0) atomicAdd(&prefix[g], 1);
  }
  __syncthreads();
  if (*failed) return;
  // Each expert rank must return exactly the rows this rank routed to it.
  for (int d = tid; d < R; d += kThreads) {
    int routed = 0;
    for (int le = 0; le < E_loc; ++le) routed += prefix[d * E_loc + le];
    if (routed != got[d]) {
      RecordError(c, kGpuBadMessage, LlOp::kCombine, d, p.seq, got[d]);
      *failed = 1;
    }
  }
  __syncthreads();
  if (*failed) return;
  BlockExclusiveScan(prefix, E, warp_sums);

  const int my_tokens = p.num_tokens > static_cast<int>(blockIdx.x) ? (p.num_tokens - blockIdx.x + G - 1) / G : 0;
  for (int round = 0; round < my_tokens; round += kWarps) {
    const int n = min(kWarps, my_tokens - round);
    if (warp < n) {
      const int t = blockIdx.x + (round + warp) * G;
      PlanTokenAnyK(c, p.topk_idx, t, K, LlOp::kCombine, p.seq, &plans[warp]);
      __syncwarp();
      if (lane < K) {
        const int g = plans[warp].id[lane];
        int64_t off = -1;
        if (g >= 0) {
          const int d = g / E_loc;
          const int pos_in = prefix[g] - prefix[d * E_loc] + plans[warp].row[lane];
          off = L.CombineRecvOffset(half, d, pos_in);
        }
        rplans[warp].row_off[lane] = off;
        rplans[warp].weight[lane] = p.topk_weights[int64_t{t} * K + lane];
      }
    }
    __syncthreads();
    const int chunks = (H + 255) / 256;  // 8 channels per lane
    for (int item = warp; item < n * chunks; item += kWarps) {
      const int tw = item / chunks, ch = item % chunks;
      const int c0 = ch * 256 + lane * 8;
      if (c0 >= H) continue;
      const int t = blockIdx.x + (round + tw) * G;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int k = 0; k < K; ++k) {
        const int64_t off = rplans[tw].row_off[k];
        if (off < 0) continue;
        const float w = rplans[tw].weight[k];
        const uint4 v = Ld16(c.peers[c.rank] + off + int64_t{c0} * 2);
        const uint32_t ws[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[2 * i] = __fmaf_rn(BitsToFloat(ws[i] << 16), w, acc[2 * i]);
          acc[2 * i + 1] = __fmaf_rn(BitsToFloat(ws[i] & 0xFFFF0000u), w, acc[2 * i + 1]);
        }
      }
      uint32_t o[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        o[i] = uint32_t{FloatToBf16(acc[2 * i])} | (uint32_t{FloatToBf16(acc[2 * i + 1])} << 16);
      St16(p.out + int64_t{t} * H + c0, make_uint4(o[0], o[1], o[2], o[3]));
    }
    __syncthreads();
  }
}

}  // namespace

// The two public kernels. Names are part of the contract (ll_kernels.h): demangled `llep::kernels::cuda::dispatch`
// and `llep::kernels::cuda::combine`.
__global__ void __launch_bounds__(kThreads, 1) dispatch(DispatchParams p, int phase) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (phase & kPhaseSend) DispatchSend(p, smem);
  if (phase & kPhaseRecv) {
    __syncthreads();
    DispatchRecv(p, smem);
  }
}

__global__ void __launch_bounds__(kThreads, 1) combine(CombineParams p, int phase) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (phase & kPhaseSend) CombineSend(p, smem);
  if (phase & kPhaseRecv) {
    __syncthreads();
    CombineRecv(p, smem);
  }
}

int64_t DispatchSharedBytes(const protocol::LlShape& s) {
  const int64_t send = static_cast<int64_t>(sizeof(DispatchSendShared)) + int64_t{4} * s.num_local_experts();
  const int64_t recv = int64_t{4} * (4 + kWarps + s.num_ranks + 1 + 2 * int64_t{s.num_experts});
  return protocol::AlignUp(send > recv ? send : recv, 16);
}

int64_t CombineSharedBytes(const protocol::LlShape& s) {
  const int64_t send = int64_t{4} * (kWarps + 4 * int64_t{s.num_experts} + s.num_ranks);
  const int64_t recv = protocol::AlignUp(int64_t{4} * (4 + kWarps + s.num_ranks + s.num_experts), 16) +
                       static_cast<int64_t>(kWarps * (sizeof(TokenPlan) + sizeof(CombineRecvPlan)));
  return protocol::AlignUp(send > recv ? send : recv, 16);
}

cudaError_t ConfigureLlKernels(int64_t bytes) {
  cudaError_t e = cudaFuncSetAttribute(dispatch, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return e;
  return cudaFuncSetAttribute(combine, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

cudaError_t LaunchDispatch(const DispatchParams& p, LlPhase phase, const LaunchConfig& cfg, cudaStream_t stream) {
  dispatch<<<cfg.num_ctas, kThreads, DispatchSharedBytes(p.ctx.layout.shape), stream>>>(p, phase);
  return cudaGetLastError();
}

cudaError_t LaunchCombine(const CombineParams& p, LlPhase phase, const LaunchConfig& cfg, cudaStream_t stream) {
  combine<<<cfg.num_ctas, kThreads, CombineSharedBytes(p.ctx.layout.shape), stream>>>(p, phase);
  return cudaGetLastError();
}

}  // namespace llep::kernels::cuda
