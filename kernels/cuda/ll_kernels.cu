// The NVLink dispatch and combine kernels (see ll_kernels.h for the contract).
//
// Work split (G CTAs of 16 warps; every CTA resident):
//  dispatch send   CTA b owns tokens b, b+G, ... in rounds of up to 16. Each round is planned by the whole CTA
//                  (PlanRound: every thread compares one earlier token with the round's tokens, giving each
//                  token's row in its (expert, source) blocks and its message slot per destination: the
//                  deterministic plan of kernels/host/route_plan.h); meanwhile each warp's first payload chunk is
//                  already loading. Then warps encode 512-channel chunks once and store them to every destination
//                  of the token, and after the round one fence and one completion add per (token, destination).
//                  Before its tokens, CTA G-1-d (strided, so the CTAs without tokens when T < G) counts the
//                  tokens per local expert for destination d and writes that route-block prefix; after its own
//                  tokens it waits for d's messages and publishes d's signal.
//  dispatch recv   every CTA waits for all R signals, reads the route-block counts and computes the packed
//                  layout (blocks in source order); warps take messages (one per warp: header, payload and
//                  scales loaded together) and fan each payload out to its rows from registers. CTA 0 writes
//                  recv_count, layout_range and the statistics.
//  combine send    every CTA reads layout_range and computes, per (local expert, home rank), the position of the
//                  block in the home rank's receive area; warps copy one row each (flattened over all blocks),
//                  each followed by a fence and a completion add; CTA d publishes rank d's signal.
//  combine recv    every CTA counts the routed rows per expert, plans its first tokens (positions from the
//                  per-expert counts and the plan), then waits for all signals and reduces top-k rows in fp32 fma
//                  order, 256 channels per warp item, exactly as the CPU backend does.
// Signals: per destination, the CTA that knows the message count polls the completion counter and publishes the
// signal word (PublishWhenDone).
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
constexpr int kChunk = 512;    // channels per dispatch work item: 16 per lane
constexpr int kCopyRegs = 16;  // 16-byte registers per lane a warp copy keeps in flight: 8 KiB per warp pass
constexpr unsigned kFull = 0xFFFFFFFFu;

// ------------------------------------------------------------------------------------------ memory model

// Signal words: protocol::LoadAcquireSys / StoreReleaseSys (runtime/protocol/sys_order.h).
__device__ __forceinline__ void FenceSys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
__device__ __forceinline__ uint64_t NowNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint4 Ld16(const void* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ void St16(void* p, const uint4& v) { *reinterpret_cast<uint4*>(p) = v; }

/// Peer bases for a warp: with R <= 32, lane r loads rank r's region base once (LanePeer, early in a phase, next to
/// the phase's first loads) and PeerBase is then a shuffle instead of a dependent global load before each store.
/// PeerBase must be called by the whole warp with the same r.
__device__ __forceinline__ uint8_t* LanePeer(const LlDeviceContext& c) {
  const int lane = threadIdx.x % 32;
  return c.layout.shape.num_ranks <= 32 && lane < c.layout.shape.num_ranks ? c.peers[lane] : nullptr;
}
__device__ __forceinline__ uint8_t* PeerBase(const LlDeviceContext& c, uint8_t* lane_peer, int r) {
  if (c.layout.shape.num_ranks > 32) return c.peers[r];
  return reinterpret_cast<uint8_t*>(__shfl_sync(0xFFFFFFFFu, reinterpret_cast<unsigned long long>(lane_peer), r));
}

/// Diagnostic timeline stamp (ll_kernels.h TracePoint) by the calling thread; one predictable branch when off.
__device__ __forceinline__ void TraceThis(const LlDeviceContext& c, LlOp op, TracePoint point) {
  if (c.trace != nullptr) c.trace[(static_cast<int64_t>(op) * gridDim.x + blockIdx.x) * kTracePoints + point] = NowNs();
}
/// The same by thread 0 of the CTA.
__device__ __forceinline__ void Trace(const LlDeviceContext& c, LlOp op, TracePoint point) {
  if (threadIdx.x == 0) TraceThis(c, op, point);
}

// ------------------------------------------------------------------------------------------ errors

__device__ void RecordError(const LlDeviceContext& c, uint32_t code, LlOp op, int peer, uint32_t seq, int64_t detail) {
  const bool fatal = code != kGpuBadExpertId && code != kGpuBadLayoutRange;
  // The thread that aborts the operation counts a timeout (metrics): once, however many CTAs and sources time out.
  if (fatal && atomicExch(&c.flags[1], 1u) == 0u && code == kGpuTimeout && c.metrics != nullptr) {
    atomicAdd(reinterpret_cast<unsigned long long*>(c.metrics + c.metrics_layout.timeouts(static_cast<int>(op))), 1ull);
  }
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

// ------------------------------------------------------------------------------------------ proxy peers

/// Rank r is reached through the proxy (no mapped region). One load, skipped when the buffer has no proxy peers.
__device__ __forceinline__ bool IsProxyPeer(const LlDeviceContext& c, int r) {
  return c.proxy_region != nullptr && c.peers[r] == nullptr;
}

/// The region a source's signal and data arrive in: proxy sources deliver into proxy_region (ll_kernels.h).
__device__ __forceinline__ const uint8_t* SrcBase(const LlDeviceContext& c, int src) {
  return IsProxyPeer(c, src) ? c.proxy_region : c.local;
}

/// Pushes a command for proxy peer `dst`; the caller fenced (system scope) the staged bytes it names. A push that
/// finds the proxy stopped records kGpuProxyFailed and returns (the operation then times out on its peers).
__device__ void PushCmd(const LlDeviceContext& c, int dst, const protocol::FifoCmd& cmd, LlOp op, uint32_t seq) {
  if (!protocol::FifoPush(c.fifos[dst], cmd)) RecordError(c, kGpuProxyFailed, op, dst, seq, 0);
}

/// Warp-collective PushCmd (converged warp): every lane with `active` pushes `cmd` for proxy peer `dst`. Lanes whose
/// peers share a ring (one proxy thread serves many peers) push together with one claim atomic and one release store
/// instruction (protocol::FifoPushWarp), a group per ring.
__device__ void PushCmdWarp(const LlDeviceContext& c, int dst, const protocol::FifoCmd& cmd, bool active, LlOp op,
                            uint32_t seq) {
  const protocol::FifoRingHandle* h = active ? &c.fifos[dst] : nullptr;
  const unsigned long long ring = active ? reinterpret_cast<unsigned long long>(h->ring) : 0ull;
  for (unsigned pending = __ballot_sync(kFull, active); pending != 0;) {
    const unsigned long long group = __shfl_sync(kFull, ring, __ffs(pending) - 1);
    const bool mine = active && ring == group && ((pending >> (threadIdx.x % 32)) & 1u);
    const protocol::FifoRingHandle handle = mine ? *h : protocol::FifoRingHandle{};
    if (!protocol::FifoPushWarp(handle, cmd, mine) && mine) RecordError(c, kGpuProxyFailed, op, dst, seq, 0);
    pending &= ~__ballot_sync(kFull, mine);
  }
}

// ------------------------------------------------------------------------------------------ metrics

/// counters[word] += v, fire-and-forget (metrics on).
__device__ __forceinline__ void AddMetric(const LlDeviceContext& c, int word, uint64_t v) {
  atomicAdd(reinterpret_cast<unsigned long long*>(c.metrics + word), static_cast<unsigned long long>(v));
}

__device__ __forceinline__ OpStamps& StampSlot(const LlDeviceContext& c, uint32_t seq) {
  return c.stamps[seq % kStampSlots];
}

/// *p = max(*p, now), fire-and-forget: the end stamps several CTAs contribute to.
__device__ __forceinline__ void StampMax(uint64_t* p) {
  atomicMax(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(NowNs()));
}

/// Bins the latencies of every operation whose receive phase a launch before this one started (so it finished:
/// stream order), except call `except` (the caller's own). One thread. Stamps that do not make sense (an operation
/// cut short by an error) are dropped rather than binned.
__device__ void BinFinishedOps(const LlDeviceContext& c, uint32_t except) {
  for (int i = 0; i < kStampSlots; ++i) {
    OpStamps& st = c.stamps[i];
    if (st.state != kStampReceiving || st.seq == except) continue;
    const uint64_t s0 = st.send_start, s1 = st.send_end, r0 = st.recv_start, w1 = st.wait_end, r1 = st.recv_end;
    st.state = kStampBinned;
    if (s1 < s0 || w1 < r0 || r1 < w1 || r1 < s0) continue;
    const uint64_t ns[protocol::kNumMetricPhases] = {s1 - s0, w1 - r0, r1 - s0};
    protocol::AddOpLatencies(c.metrics_layout, static_cast<int>(st.op), ns,
                             [&](int word, uint64_t v) { AddMetric(c, word, v); });
  }
}

/// Every source's signal seen (CTA 0, thread 0, after the CTA's wait).
__device__ __forceinline__ void StampWaitEnd(const LlDeviceContext& c, uint32_t seq) {
  if (c.metrics != nullptr && blockIdx.x == 0 && threadIdx.x == 0) StampSlot(c, seq).wait_end = NowNs();
}

/// The CTA's receive work is done (all threads, after it): thread 0 contributes the receive end.
__device__ __forceinline__ void StampRecvEnd(const LlDeviceContext& c, uint32_t seq) {
  if (c.metrics == nullptr) return;
  __syncthreads();
  if (threadIdx.x == 0) StampMax(&StampSlot(c, seq).recv_end);
}

/// Send phase entered (CTA 0, thread 0): the slot now belongs to call `seq`.
__device__ __forceinline__ void StampSendStart(const LlDeviceContext& c, LlOp op, uint32_t seq) {
  if (c.metrics == nullptr || blockIdx.x != 0 || threadIdx.x != 0) return;
  OpStamps& st = StampSlot(c, seq);
  st.seq = seq;
  st.op = static_cast<uint32_t>(op);
  st.send_start = NowNs();
  st.state = kStampSent;
}

/// Receive phase entered (CTA 0, thread 0). A slot that does not hold this call's send stamps (only possible if
/// more calls were in flight than the ring covers, which the host refuses) is left alone: no latency is invented.
__device__ __forceinline__ void StampRecvStart(const LlDeviceContext& c, uint32_t seq) {
  if (c.metrics == nullptr || blockIdx.x != 0 || threadIdx.x != 0) return;
  OpStamps& st = StampSlot(c, seq);
  if (st.seq != seq || st.state != kStampSent) return;
  st.recv_start = NowNs();
  st.state = kStampReceiving;
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
  // Metrics: the last CTA's last thread bins earlier operations' latencies meanwhile, and CTA 0 accounts the waits.
  // The last CTA, because receive work starts at CTA 0 (tokens b, b + G, ...): with T < G it has none, so the
  // binning's dependent loads delay nobody (CTA 0 doing it cost 1.1 us of combine receive at T=1 on 4xH200).
  if (c.metrics != nullptr && blockIdx.x == gridDim.x - 1 && threadIdx.x == kThreads - 1) BinFinishedOps(c, seq);
  for (int src = threadIdx.x; src < c.layout.shape.num_ranks; src += kThreads) {
    int64_t waited = 0;
    int64_t v;
    if (IsProxyPeer(c, src)) {
      // A proxy source signals in host memory. CTA 0 alone polls it there and forwards the word to a device-memory
      // mirror the other CTAs poll: every CTA polling host memory floods PCIe with reads and slows the whole path.
      uint64_t* mirror =
          c.proxy_signals + (half * protocol::kNumLlOps + static_cast<int>(op)) * c.layout.shape.num_ranks + src;
      if (blockIdx.x == 0) {
        v = WaitSignal(c, reinterpret_cast<const uint64_t*>(c.proxy_region + c.layout.SignalOffset(half, op, src)), op,
                       src, seq, &waited);
        // This thread's acquire saw the proxy's release; its release here carries that to the other CTAs.
        if (v >= 0) protocol::StoreReleaseSys(mirror, protocol::PackSignal(seq, static_cast<uint32_t>(v)));
      } else {
        v = WaitSignal(c, mirror, op, src, seq, &waited);
      }
    } else {
      v = WaitSignal(c, reinterpret_cast<const uint64_t*>(c.local + c.layout.SignalOffset(half, op, src)), op, src, seq,
                     &waited);
    }
    if (v > max_value) RecordError(c, kGpuBadMessage, op, src, seq, v);
    const bool ok = v >= 0 && v <= max_value;
    if (!ok) *failed = 1;
    values[src] = ok ? static_cast<int>(v) : 0;
    if (blockIdx.x == 0 && wait_stats != nullptr) {
      atomicAdd(reinterpret_cast<unsigned long long*>(&wait_stats[src]), static_cast<unsigned long long>(waited));
    }
    if (blockIdx.x == 0 && c.metrics != nullptr) {
      AddMetric(c, c.metrics_layout.recv_wait_ns(static_cast<int>(op), src), static_cast<uint64_t>(waited));
    }
  }
}

// Completion of an operation towards one destination: a 64-bit counter per (half, op, dst) (LlDeviceContext::done)
// gets one fire-and-forget add per message, each after its sender's system-scope fence; the CTA that knows the
// message count n polls the counter until it reads n, resets it for the next call on this half (stream-ordered
// after this launch) and publishes the signal word with a release store. Measured against "the add that completes
// the count publishes" (adds that return a value): equal at T=128, 2.7 us faster at T=1 (senders never wait).
__device__ __forceinline__ void AddDone(const LlDeviceContext& c, LlOp op, int half, int dst) {
  atomicAdd(reinterpret_cast<unsigned long long*>(
                c.done + (half * protocol::kNumLlOps + static_cast<int>(op)) * c.layout.shape.num_ranks + dst),
            1ull);
}

__device__ void PublishWhenDone(const LlDeviceContext& c, LlOp op, int half, int dst, uint32_t n, uint32_t seq) {
  uint64_t* ctr = c.done + (half * protocol::kNumLlOps + static_cast<int>(op)) * c.layout.shape.num_ranks + dst;
  const uint64_t t0 = NowNs();
  for (uint32_t spin = 0;; ++spin) {
    uint64_t v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(ctr) : "memory");
    if (v == n) break;
    if ((spin & 255u) == 255u && (Aborted(c) || NowNs() - t0 > c.timeout_ns)) {
      RecordError(c, kGpuTimeout, op, c.rank, seq, -1);  // local: a CTA of this launch never finished
      return;
    }
  }
  *ctr = 0;
  uint8_t* const peer = c.peers[dst];
  if (peer != nullptr) {
    protocol::StoreReleaseSys(reinterpret_cast<uint64_t*>(peer + c.layout.SignalOffset(half, op, c.rank)),
                              protocol::PackSignal(seq, n));
  } else {
    // Proxy peer: every message's write command is in the ring (each CTA pushed before its completion add). The
    // dispatch route block (counts by this CTA, headers by all, fenced before their adds) goes last, then the signal.
    const protocol::LlLayout& L = c.layout;
    if (op == LlOp::kDispatch) {
      PushCmd(c, dst,
              protocol::MakeWriteCmd(op, half, dst, L.RouteSendOffset(half, dst), L.RouteRecvOffset(half, c.rank),
                                     protocol::RouteBlockUsedBytes(L.shape, static_cast<int>(n))),
              op, seq);
    }
    PushCmd(c, dst, protocol::MakeSignalCmd(op, half, dst, protocol::PackSignal(seq, n)), op, seq);
  }
  if (c.metrics != nullptr) StampMax(&StampSlot(c, seq).send_end);
  TraceThis(c, op, kTracePublished);
}

// ------------------------------------------------------------------------------------------ routing

// The routing validation rule, applied by every phase so a bad row is treated identically everywhere and the
// buffer stays consistent: a topk id outside [-1, E) and an id an earlier slot of the same token already selected
// become -1 ("no expert") and are recorded. It has two forms over one pair of helpers: the warp form (a lane per
// slot, for the token plan) and the thread form (a thread per token, for the histograms).

/// Rule part 1: topk value v as an expert id, -1 (recorded) when outside [-1, E).
__device__ __forceinline__ int InRangeId(const LlDeviceContext& c, int64_t v, LlOp op, uint32_t seq) {
  const bool in_range = v >= -1 && v < c.layout.shape.num_experts;
  if (!in_range) RecordError(c, kGpuBadExpertId, op, -1, seq, v);
  return in_range ? static_cast<int>(v) : -1;
}

/// Rule part 2: id, or -1 (recorded) when an earlier slot of the token selected it already (`repeated`).
__device__ __forceinline__ int UnlessRepeated(const LlDeviceContext& c, int id, bool repeated, int64_t v, LlOp op,
                                              uint32_t seq) {
  if (repeated) RecordError(c, kGpuBadExpertId, op, -1, seq, v);
  return repeated ? -1 : id;
}

/// Warp form: topk_idx[t][lane] validated, lanes >= K get -1. One coalesced load per token; the repeat check runs
/// on shuffles (trace on H200: the per-slot scalar loads it replaced cost 3.6 us per token plan; a thread-form load
/// of the whole row by every lane, measured on 4xH200, cost 1 us of dispatch send at T=1).
__device__ int WarpTokenExpert(const LlDeviceContext& c, const int64_t* topk, int t, int K, LlOp op, uint32_t seq) {
  const int lane = threadIdx.x % 32;
  const int64_t v = lane < K ? topk[static_cast<int64_t>(t) * K + lane] : -1;
  const int id = InRangeId(c, v, op, seq);
  bool repeated = false;
  for (int j = 0; j < K - 1; ++j) {
    const int other = __shfl_sync(kFull, id, j);
    repeated |= j < lane && id >= 0 && other == id;
  }
  return UnlessRepeated(c, id, repeated, v, op, seq);
}

/// Thread form: the calling thread loads token t's whole row at once (one round of independent loads instead of
/// one dependent load per token of a warp loop) and gets its validated ids in ids[0, kMaxK), slots >= K set to -1.
template <int kMaxK>
__device__ __forceinline__ void LoadTokenIds(const LlDeviceContext& c, const int64_t* topk, int t, int K, LlOp op,
                                             uint32_t seq, int (&ids)[kMaxK]) {
  const int64_t* r = topk + static_cast<int64_t>(t) * K;
  int64_t v[kMaxK];
#pragma unroll
  for (int k = 0; k < kMaxK; ++k) v[k] = k < K ? r[k] : -1;
  int valid[kMaxK];
#pragma unroll
  for (int k = 0; k < kMaxK; ++k) {
    valid[k] = InRangeId(c, v[k], op, seq);
    bool repeated = false;
#pragma unroll
    for (int j = 0; j < k; ++j) repeated |= valid[k] >= 0 && valid[j] == valid[k];
    ids[k] = UnlessRepeated(c, valid[k], repeated, v[k], op, seq);
  }
}

template <int N>
__device__ constexpr int Len(const int (&)[N]) {
  return N;
}

/// Calls f(ids) with token t's validated ids (LoadTokenIds) in a register array of 8 entries when K <= 8 (the
/// common top-8), else of kMaxTopK; f iterates k < Len(ids).
template <typename F>
__device__ __forceinline__ void WithTokenIds(const LlDeviceContext& c, const int64_t* topk, int t, int K, LlOp op,
                                             uint32_t seq, F&& f) {
  if (K <= 8) {
    int ids[8];
    LoadTokenIds<8>(c, topk, t, K, op, seq, ids);
    f(ids);
  } else {
    int ids[kK];
    LoadTokenIds<kK>(c, topk, t, K, op, seq, ids);
    f(ids);
  }
}

/// The plan of one token, written by one warp into shared memory.
struct TokenPlan {
  int id[kK];      ///< validated expert id per slot, -1 = skipped
  int row[kK];     ///< row_in_block: earlier tokens that select the same expert
  int slot[kK];    ///< message slot of this token on the slot's destination rank
  int dst[kK];     ///< destination rank of the slot, -1 = skipped
  uint32_t opens;  ///< bit k: slot k is the token's first on its rank, the slot that owns the (token, rank) message
};

// Route keys for PlanRound: rank << 16 | local expert (both fit: a rank and a local expert id are below 65536, and
// E <= 2^20 keeps them from both being 65535), kNoKey for "no expert".
constexpr uint32_t kNoKey = 0xFFFFFFFFu;

__device__ __forceinline__ uint32_t RouteKey(int64_t id, int E, int E_loc) {
  if (id < 0 || id >= E) return kNoKey;
  const int g = static_cast<int>(id);
  return static_cast<uint32_t>(g / E_loc) << 16 | static_cast<uint32_t>(g % E_loc);
}

/// PlanRound's shared memory: the keys of the round's tokens and their row / slot counters.
struct PlanScratch {
  uint32_t key[kWarps][kK];
  int row[kWarps][kK];
  int slot[kWarps][kK];
};

/// The plans of one round's tokens (route_plan.h definitions), a CTA-wide call: token w < n of the round is
/// first_t + w * stride, its plan goes to out[w]. Row and slot count the earlier tokens t' < t that select the same
/// expert / send to the same rank. Every thread takes one earlier token (one round of independent loads for up to
/// 512 of them), compares it with each planned token, and the counts meet through warp reductions and shared
/// atomics: the whole CTA works on the plan instead of one warp scanning serially. (H200 trace, T=128, 2 ranks:
/// plan ready at 8.5 us with the serial scan, 6.3 us like this; a fully unrolled scan was far worse, ~30 us, as its
/// straight-line code missed the instruction cache.)
template <int kMaxK>
__device__ void PlanRound(const LlDeviceContext& c, const int64_t* topk, int first_t, int stride, int n, int K, LlOp op,
                          uint32_t seq, PlanScratch* sc, TokenPlan* out) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int E = c.layout.shape.num_experts, E_loc = c.layout.shape.num_local_experts();
  const int t_last = first_t + (n - 1) * stride;  // the round's last token: earlier tokens are [0, t_last)
  const auto load_row = [&](int tp, uint32_t(&q)[kMaxK]) {
    const int64_t* r = topk + static_cast<int64_t>(tp) * K;
    int64_t v[kMaxK];
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) v[j] = (tp < t_last && j < K) ? r[j] : -1;
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) q[j] = RouteKey(v[j], E, E_loc);
  };
  uint32_t q[kMaxK];
  load_row(tid, q);  // issued before the planned tokens' own loads: both are in flight together
  if (warp < n) {
    const int id = WarpTokenExpert(c, topk, first_t + warp * stride, K, op, seq);
    if (lane < kK) {
      sc->key[warp][lane] = RouteKey(id, E, E_loc);
      sc->row[warp][lane] = 0;
      sc->slot[warp][lane] = 0;
      out[warp].id[lane] = id;
    }
  }
  __syncthreads();
  for (int base = 0; base < t_last; base += kThreads) {
    const int tp = base + tid;
    if (base > 0) load_row(tp, q);
    for (int w = 0; w < n; ++w) {
      const bool earlier = tp < first_t + w * stride;
#pragma unroll
      for (int k = 0; k < kMaxK; ++k) {
        const uint32_t key = sc->key[w][k];
        bool same_expert = false, same_rank = false;
#pragma unroll
        for (int j = 0; j < kMaxK; ++j) {
          same_expert |= q[j] == key;
          same_rank |= q[j] != kNoKey && (q[j] >> 16) == (key >> 16);
        }
        const int r = __reduce_add_sync(kFull, earlier && same_expert && key != kNoKey ? 1 : 0);
        const int s = __reduce_add_sync(kFull, earlier && same_rank ? 1 : 0);
        if (lane == 0 && r != 0) atomicAdd(&sc->row[w][k], r);
        if (lane == 0 && s != 0) atomicAdd(&sc->slot[w][k], s);
      }
    }
  }
  __syncthreads();
  if (warp < n) {
    const uint32_t key = lane < kK ? sc->key[warp][lane] : kNoKey;
    const int dst = key == kNoKey ? -1 : static_cast<int>(key >> 16);
    const unsigned same_rank = __match_any_sync(kFull, dst);
    const unsigned opens = __ballot_sync(kFull, dst >= 0 && __ffs(same_rank) - 1 == lane);
    if (lane < kK) {
      out[warp].row[lane] = sc->row[warp][lane];
      out[warp].slot[lane] = sc->slot[warp][lane];
      out[warp].dst[lane] = dst;
    }
    if (lane == 0) out[warp].opens = opens;
  }
}

/// PlanRound with registers for top-8 when K <= 8, else for kMaxTopK. Every thread of the CTA calls it; the plans
/// are visible to the CTA after the caller's next barrier.
__device__ void PlanRoundAnyK(const LlDeviceContext& c, const int64_t* topk, int first_t, int stride, int n, int K,
                              LlOp op, uint32_t seq, PlanScratch* sc, TokenPlan* out) {
  if (K <= 8) {
    PlanRound<8>(c, topk, first_t, stride, n, K, op, seq, sc, out);
  } else {
    PlanRound<kK>(c, topk, first_t, stride, n, K, op, seq, sc, out);
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

// Dispatch send's shared memory: DispatchSendShared, counts[E_loc], then PlanRound's scratch.
__host__ __device__ int64_t DispatchScratchOffset(const protocol::LlShape& s) {
  return protocol::AlignUp(static_cast<int64_t>(sizeof(DispatchSendShared)) + int64_t{4} * s.num_local_experts(), 16);
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

__device__ void DispatchSend(const DispatchParams& p, uint32_t seq, uint8_t* smem) {
  const LlDeviceContext& c = p.ctx;
  const protocol::LlLayout& L = c.layout;
  const int R = L.shape.num_ranks, E_loc = L.shape.num_local_experts(), H = L.shape.hidden;
  const int K = p.num_topk, half = protocol::HalfOfSeq(seq);
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
            const bool hit = ids[k] >= 0 && ids[k] / E_loc == d;
            if (hit) atomicAdd(&counts[ids[k] % E_loc], 1);
            hit_any |= hit;
          }
        });
      }
      const int tokens = __popc(__ballot_sync(kFull, hit_any));
      if (lane == 0 && tokens > 0) atomicAdd(&sh->tokens_to_dst[k_dst], tokens);
    }
    __syncthreads();
    uint8_t* const peer_d = c.peers[d];  // proxy peer (null): counts are staged in the route block sent at publish
    auto* remote_counts = reinterpret_cast<uint32_t*>(peer_d != nullptr ? peer_d + L.RouteRecvOffset(half, c.rank)
                                                                        : c.proxy_region + L.RouteSendOffset(half, d));
    for (int i = tid; i < E_loc; i += kThreads) remote_counts[i] = static_cast<uint32_t>(counts[i]);
    if (c.metrics != nullptr) {  // selections sent to d: a warp reduction per 32 local experts
      for (int i0 = warp * 32; i0 < E_loc; i0 += kThreads) {
        const unsigned v = __reduce_add_sync(kFull, i0 + lane < E_loc ? static_cast<unsigned>(counts[i0 + lane]) : 0u);
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
  k_dst = 0;
  for (int d = G - 1 - static_cast<int>(blockIdx.x); d < R; d += G, ++k_dst) {
    if (tid == 0) PublishWhenDone(c, LlOp::kDispatch, half, d, static_cast<uint32_t>(sh->tokens_to_dst[k_dst]), seq);
  }
}

// A warp copy pass: kCopyRegs 16-byte registers per lane, all loads of a pass in flight together.
constexpr int64_t kCopyPassBytes = kCopyRegs * 512;

__device__ __forceinline__ void LoadCopyPass(const uint8_t* src, int64_t bytes, int64_t base, uint4 (&v)[kCopyRegs]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < kCopyRegs; ++i) {
    const int64_t off = base + i * 512 + lane * 16;
    v[i] = off < bytes ? Ld16(src + off) : make_uint4(0, 0, 0, 0);
  }
}

__device__ __forceinline__ void StoreCopyPass(uint8_t* dst, int64_t bytes, int64_t base, const uint4 (&v)[kCopyRegs]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < kCopyRegs; ++i) {
    const int64_t off = base + i * 512 + lane * 16;
    if (off < bytes) St16(dst + off, v[i]);
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

__device__ void DispatchRecv(const DispatchParams& p, uint32_t seq, uint8_t* smem) {
  const LlDeviceContext& c = p.ctx;
  const protocol::LlLayout& L = c.layout;
  const int R = L.shape.num_ranks, E_loc = L.shape.num_local_experts(), H = L.shape.hidden;
  const int T = L.shape.max_tokens_per_rank, E = L.shape.num_experts;
  const int64_t rows = L.shape.max_recv_rows();
  const int half = protocol::HalfOfSeq(seq), num_scales = L.shape.num_scales();
  const int num_packed = L.shape.num_packed_ue8m0();
  const bool fp8 = p.mode.use_fp8;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, G = gridDim.x;
  // Shared: failed flag, warp sums, msg_start[R + 1], cnt[E] ([src][le]), begin[E] ([src][le]).
  int* failed = reinterpret_cast<int*>(smem);
  int* warp_sums = failed + 4;
  int* msg_start = warp_sums + kWarps;
  int* cnt = msg_start + R + 1;
  int* begin = cnt + E;

  Trace(c, LlOp::kDispatch, kTraceRecvStart);
  if (tid == 0) *failed = 0;
  __syncthreads();
  WaitAllSources(c, LlOp::kDispatch, half, seq, T, p.wait_stats, msg_start, failed);  // messages per source
  __syncthreads();
  Trace(c, LlOp::kDispatch, kTraceSignals);
  StampWaitEnd(c, seq);
  if (*failed) return;
  for (int i = tid; i < E; i += kThreads) {
    const int src = i / E_loc, le = i % E_loc;
    const uint32_t v = reinterpret_cast<const uint32_t*>(SrcBase(c, src) + L.RouteRecvOffset(half, src))[le];
    if (v > static_cast<uint32_t>(T)) {
      RecordError(c, kGpuBadMessage, LlOp::kDispatch, src, seq, -1);
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
      if (c.metrics != nullptr) AddMetric(c, c.metrics_layout.expert_recv_tokens(le), static_cast<uint64_t>(acc));
    }
  }
  if (tid == 0) msg_start[R] = 0;
  __syncthreads();
  const int total = BlockExclusiveScan(msg_start, R + 1, warp_sums);
  Trace(c, LlOp::kDispatch, kTraceRecvPlanned);

  const int64_t bytes = fp8 ? H : int64_t{2} * H;
  for (int m = warp * G + blockIdx.x; m < total; m += G * kWarps) {
    const int src = FindBlock(msg_start, R, m), j = m - msg_start[src];
    const uint8_t* in = SrcBase(c, src);
    const uint8_t* hdr = in + L.RouteHeaderOffset(L.RouteRecvOffset(half, src), j);
    const uint8_t* payload = in + L.DispatchRecvOffset(half, src, j, fp8);
    const float* scales = reinterpret_cast<const float*>(payload + protocol::Fp8ScalesOffset(H));
    // The header, the payload's first pass and the first scales are independent loads: all issued together.
    const uint32_t word = lane < 20 ? reinterpret_cast<const uint32_t*>(hdr)[lane] : 0u;
    uint4 v[kCopyRegs];
    LoadCopyPass(payload, bytes, 0, v);
    float sc[4];
    if (fp8) LoadScalePass(scales, num_scales, 0, p.mode.use_ue8m0, sc);
    const int src_token = static_cast<int>(__shfl_sync(kFull, word, 0));
    const uint32_t w1 = __shfl_sync(kFull, word, 1);
    const int num_sel = static_cast<int>(w1 & 0xFFFF);
    const bool ok = (w1 >> 16) == protocol::kDispatchMsgVersion && __shfl_sync(kFull, word, 2) == seq &&
                    ((__shfl_sync(kFull, word, 3) & protocol::kMsgFlagFp8) != 0) == fp8 && num_sel >= 1 &&
                    num_sel <= kK && src_token >= 0 && src_token < T;
    if (!ok) {
      if (lane == 0) RecordError(c, kGpuBadMessage, LlOp::kDispatch, src, seq, j);
      continue;
    }
    // Lane i < num_sel resolves selection i to its output row; rejected selections are recorded and skipped.
    const uint32_t sel = __shfl_sync(kFull, word, (4 + lane) & 31);
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
        p.src_info[my_row] = src_token;
      }
    }
    if (__any_sync(kFull, bad) && lane == 0) RecordError(c, kGpuBadMessage, LlOp::kDispatch, src, seq, j);
    const unsigned targets = __ballot_sync(kFull, my_row >= 0);
    // The payload goes through registers: loaded once per pass, stored to every selection's row.
    for (int64_t base = 0; base < bytes; base += kCopyPassBytes) {
      if (base > 0) LoadCopyPass(payload, bytes, base, v);
      for (unsigned t = targets; t != 0; t &= t - 1) {
        const int64_t row = __shfl_sync(kFull, my_row, __ffs(t) - 1);
        StoreCopyPass(static_cast<uint8_t*>(p.recv_x) + row * bytes, bytes, base, v);
      }
    }
    if (!fp8) continue;
    // Scales, 128 per pass (4 per lane). fp32: [E_loc, H/128, R*T]; packed UE8M0: int32 [E_loc, H/512, R*T], byte
    // g % 4 of word (le, g / 4, row) is group g's exponent.
    for (int g0 = 0; g0 < num_scales; g0 += 128) {
      if (g0 > 0) LoadScalePass(scales, num_scales, g0, p.mode.use_ue8m0, sc);
      uint32_t packed = 0;
#pragma unroll
      for (int b = 0; b < 4 && p.mode.use_ue8m0; ++b) packed |= uint32_t{Ue8m0FromScaleInv(sc[b])} << (8 * b);
      for (unsigned t = targets; t != 0; t &= t - 1) {
        const int i_sel = __ffs(t) - 1;
        const int le = __shfl_sync(kFull, my_le, i_sel);
        const int64_t rr = __shfl_sync(kFull, my_rr, i_sel);
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
    const int64_t n = v & 0xFFFFFFFF, b = v >> 32;
    const bool ok = n <= T && b >= 0 && b + n <= rows;
    if (!ok) RecordError(c, kGpuBadLayoutRange, LlOp::kCombine, q % R, seq, q);
    cnt[q] = ok ? static_cast<int>(n) : 0;
    beg[q] = ok ? static_cast<int>(b) : 0;
    pos[(q % R) * E_loc + q / R] = cnt[q];
  }
  __syncthreads();
  const int pos_total = BlockExclusiveScan(pos, E, warp_sums);  // (one scan instead of a serial loop per rank)
  for (int d = tid; d < R; d += kThreads) {
    const int n = (d + 1 < R ? pos[(d + 1) * E_loc] : pos_total) - pos[d * E_loc];
    const bool ok = n <= L.combine_rows_per_src;  // more rows than the home rank's receive area holds: send none
    if (!ok) RecordError(c, kGpuBadLayoutRange, LlOp::kCombine, d, seq, n);
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
    const uint8_t* src = p.x != nullptr ? reinterpret_cast<const uint8_t*>(p.x + (int64_t{le} * rows + src_row) * H)
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
      WaitAllSources(c, LlOp::kCombine, half, seq, L.combine_rows_per_src, p.wait_stats, got, failed);
      __syncthreads();
      Trace(c, LlOp::kCombine, kTraceSignals);
      StampWaitEnd(c, seq);
      for (int d = tid; d < R; d += kThreads) {
        if (!*failed && routed[d] != got[d]) {
          RecordError(c, kGpuBadMessage, LlOp::kCombine, d, seq, got[d]);
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

// ------------------------------------------------------------------------------------------ call state

/// Loads a call record bypassing L1 (the record was written by earlier launches, on any SM).
__device__ __forceinline__ LlCallRecord LoadRecord(const LlCallRecord* r) {
  LlCallRecord v;
  const uint4* src = reinterpret_cast<const uint4*>(r);
  uint4* dst = reinterpret_cast<uint4*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) dst[i] = __ldcg(src + i);
  return v;
}

/// a is b or a later sequence number.
__device__ __forceinline__ bool AtOrAfter(uint32_t a, uint32_t b) { return a == b || protocol::SignalIsNewer(a, b); }

/// Thread 0 of every CTA of a launch with a send phase: the operation's sequence number, after the in-flight rules
/// (LlCallState); 0 if a rule refuses the send (CTA 0 records why) or an earlier fatal error aborted the buffer.
__device__ uint32_t TakeCallSeq(const LlDeviceContext& c, LlOp op, unsigned long long* n_out) {
  LlCallState* s = c.calls;
  // Both records and the abort flag load while the atomic is in flight: one round trip on the critical path.
  const LlCallRecord r0 = LoadRecord(&s->record[0]), r1 = LoadRecord(&s->record[1]);
  const bool aborted = Aborted(c);
  const unsigned long long n = atomicAdd(&s->send_ctas, 1ull) / gridDim.x;
  *n_out = n;
  const uint32_t seq = protocol::DeviceCallSeq(n);
  const int h = protocol::HalfOfSeq(seq);
  const LlCallRecord& r = h == 0 ? r0 : r1;
  const uint32_t prev = static_cast<uint32_t>(r.sent[h]);
  const uint32_t sent_after = r.sent_after[static_cast<int>(op)][h];
  uint32_t code = kGpuOk, detail = 0;
  if (prev != 0 && static_cast<uint32_t>(r.received[h] >> 32) != prev) {
    code = kGpuInFlight;
    detail = prev;
  } else if (sent_after != 0 && (r.newest_received == 0 || !AtOrAfter(r.newest_received, sent_after))) {
    code = kGpuRegionBusy;
    detail = sent_after;
  }
  if (code != kGpuOk && blockIdx.x == 0) RecordError(c, code, op, -1, seq, detail);
  return code == kGpuOk && !aborted ? seq : 0u;
}

/// Send n is done (last CTA, thread 0, after its send phase): the record the next send reads, with this send in it
/// (received at once for kPhaseBoth).
__device__ void TrackSend(const LlDeviceContext& c, LlOp op, int phase, uint32_t tag, unsigned long long n) {
  const uint32_t seq = protocol::DeviceCallSeq(n);
  const int h = protocol::HalfOfSeq(seq);
  LlCallRecord r = LoadRecord(&c.calls->record[h]);
  r.sent[h] = PackSent(tag, seq);
  if (phase == kPhaseBoth) {
    r.received[h] = PackReceived(seq, kReceivedInLaunch);
    r.sent_after[static_cast<int>(op)][h] = protocol::DeviceCallSeq(n + 1);
    if (r.newest_received == 0 || protocol::SignalIsNewer(seq, r.newest_received)) r.newest_received = seq;
  }
  c.calls->record[h ^ 1] = r;
}

/// Thread 0 of every CTA of a receive-only launch: the sequence number of the sent, unreceived operation `tag` names
/// (the older one if two do), marked received by this launch in the record the next send reads; 0 if none does
/// (kGpuBadReceive recorded) or the buffer aborted. See LlCallState for why every CTA reaches the same answer.
__device__ uint32_t TakeReceivedSeq(const LlDeviceContext& c, LlOp op, uint32_t tag) {
  LlCallState* s = c.calls;
  const LlCallRecord r0 = LoadRecord(&s->record[0]), r1 = LoadRecord(&s->record[1]);
  const bool aborted = Aborted(c);
  const unsigned long long next_send = __ldcg(&s->send_ctas) / gridDim.x;  // no send runs during this launch
  // The receive launch's index, never kReceivedInLaunch.
  const uint32_t launch = static_cast<uint32_t>((atomicAdd(&s->recv_ctas, 1ull) / gridDim.x) % kReceivedInLaunch);
  const LlCallRecord& r = (next_send & 1) == 0 ? r0 : r1;
  int half = -1;
  uint32_t seq = 0;
  for (int h = 0; h < protocol::kNumHalves; ++h) {
    const uint32_t sent_seq = static_cast<uint32_t>(r.sent[h]);
    const unsigned long long mark = r.received[h];
    const bool waiting =
        sent_seq != 0 && (static_cast<uint32_t>(mark >> 32) != sent_seq || static_cast<uint32_t>(mark) == launch);
    if ((r.sent[h] >> 32) == tag && waiting && (half < 0 || protocol::SignalIsNewer(seq, sent_seq))) {
      half = h;
      seq = sent_seq;
    }
  }
  if (aborted) return 0;
  if (half < 0) {
    if (blockIdx.x == 0) RecordError(c, kGpuBadReceive, op, -1, 0, tag);
    return 0;
  }
  // Every CTA stores the same values (newest_received included: the maximum with seq either way).
  LlCallRecord* out = &s->record[next_send & 1];
  out->received[half] = PackReceived(seq, launch);
  out->sent_after[static_cast<int>(op)][half] = protocol::DeviceCallSeq(next_send);
  if (r.newest_received == 0 || protocol::SignalIsNewer(seq, r.newest_received)) out->newest_received = seq;
  return seq;
}

/// A launch of one operation: its send phase, its receive phase, or both (kPhaseBoth), with the call state and the
/// metrics stamps around them. The two public kernels differ only in their phase functions.
template <typename Params>
__device__ __forceinline__ void RunPhases(const Params& p, LlOp op, int phase, uint8_t* smem,
                                          void (*send)(const Params&, uint32_t, uint8_t*),
                                          void (*recv)(const Params&, uint32_t, uint8_t*)) {
  const LlDeviceContext& c = p.ctx;
  __shared__ uint32_t call_seq;
  __shared__ unsigned long long call_n;  // send launches: the launch's index (LlCallState)
  if (threadIdx.x == 0) {
    call_seq = (phase & kPhaseSend) ? TakeCallSeq(c, op, &call_n) : TakeReceivedSeq(c, op, p.call_tag);
  }
  __syncthreads();
  const uint32_t seq = call_seq;
  if (seq == 0) return;  // refused (recorded) or aborted: this launch does nothing
  if (phase & kPhaseSend) {
    StampSendStart(c, op, seq);
    send(p, seq, smem);
    if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) TrackSend(c, op, phase, p.call_tag, call_n);
  }
  if (phase & kPhaseRecv) {
    __syncthreads();
    StampRecvStart(c, seq);
    recv(p, seq, smem);
    StampRecvEnd(c, seq);
  }
}

}  // namespace

// The two public kernels. Names are part of the contract (ll_kernels.h): demangled `llep::kernels::cuda::dispatch`
// and `llep::kernels::cuda::combine`.
__global__ void __launch_bounds__(kThreads, 1) dispatch(DispatchParams p, int phase) {
  extern __shared__ __align__(16) uint8_t smem[];
  RunPhases(p, LlOp::kDispatch, phase, smem, DispatchSend, DispatchRecv);
}

__global__ void __launch_bounds__(kThreads, 1) combine(CombineParams p, int phase) {
  extern __shared__ __align__(16) uint8_t smem[];
  RunPhases(p, LlOp::kCombine, phase, smem, CombineSend, CombineRecv);
}

// Metrics flush: a separate kernel so the two contract kernels keep their launch shape.
__global__ void bin_finished_ops(LlDeviceContext c) { BinFinishedOps(c, 0); }

cudaError_t FlushLlMetrics(const LlDeviceContext& ctx, cudaStream_t stream) {
  if (ctx.metrics == nullptr) return cudaSuccess;
  bin_finished_ops<<<1, 1, 0, stream>>>(ctx);
  return cudaGetLastError();
}

int64_t DispatchSharedBytes(const protocol::LlShape& s) {
  const int64_t send = DispatchScratchOffset(s) + static_cast<int64_t>(sizeof(PlanScratch));
  const int64_t recv = int64_t{4} * (4 + kWarps + s.num_ranks + 1 + 2 * int64_t{s.num_experts});
  return protocol::AlignUp(send > recv ? send : recv, 16);
}

int64_t CombineSharedBytes(const protocol::LlShape& s) {
  const int64_t send = int64_t{4} * (kWarps + 4 * int64_t{s.num_experts} + s.num_ranks);
  const int64_t recv = protocol::AlignUp(int64_t{4} * (4 + kWarps + 2 * s.num_ranks + s.num_experts), 16) +
                       static_cast<int64_t>(kWarps * (sizeof(TokenPlan) + sizeof(CombineRecvPlan))) +
                       static_cast<int64_t>(sizeof(PlanScratch));
  return protocol::AlignUp(send > recv ? send : recv, 16);
}

cudaError_t ConfigureLlKernels(int64_t bytes) {
  cudaError_t e = cudaFuncSetAttribute(dispatch, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return e;
  return cudaFuncSetAttribute(combine, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

namespace {

/// A launch with a send phase has CTAs that wait for other CTAs of the same launch (PublishWhenDone polls the
/// completion counter the other CTAs add to; a kPhaseBoth launch also waits for signals its own send phase
/// publishes). That needs every CTA resident at once, which only the cooperative attribute guarantees: without it, a
/// kernel on another stream (a GEMM, the other micro-batch's launch) can hold SMs while launched CTAs spin, and the
/// operation stalls until the timeout. A receive-only launch waits only for peers, so it launches plainly.
template <typename Params>
cudaError_t LaunchLl(void (*kernel)(Params, int), const Params& p, LlPhase phase, const LaunchConfig& cfg,
                     int64_t shared_bytes, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(cfg.num_ctas));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = static_cast<size_t>(shared_bytes);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = (phase & kPhaseSend) != 0 ? 1 : 0;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, p, static_cast<int>(phase));
}

}  // namespace

cudaError_t LaunchDispatch(const DispatchParams& p, LlPhase phase, const LaunchConfig& cfg, cudaStream_t stream) {
  return LaunchLl(dispatch, p, phase, cfg, DispatchSharedBytes(p.ctx.layout.shape), stream);
}

cudaError_t LaunchCombine(const CombineParams& p, LlPhase phase, const LaunchConfig& cfg, cudaStream_t stream) {
  return LaunchLl(combine, p, phase, cfg, CombineSharedBytes(p.ctx.layout.shape), stream);
}

}  // namespace llep::kernels::cuda
