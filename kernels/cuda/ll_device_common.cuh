// What every phase of the low-latency kernels uses: launch constants, the memory model, error records, proxy FIFO
// pushes and metrics stamps (the signal protocol built on them: ll_signals.cuh).
// Part of the kernels' device code (ll_run_phases.cuh includes the parts into each translation unit that compiles
// kernels, kernels/cuda/ll_kernels*.cu; each part reopens the same private namespace): split by phase so a reader can
// hold each part.
#pragma once

#include <cstddef>

#include "kernels/cuda/ll_kernels.h"
#include "runtime/protocol/gpu_port.h"
#include "runtime/protocol/signal.h"
#include "runtime/protocol/sys_order.h"

namespace llep::kernels::cuda {
namespace {

using protocol::LlOp;

constexpr int kWarps = kWarpsPerCta;  // a CTA plans (and keeps the plan of) one token per warp
constexpr int kThreads = kWarps * 32;
constexpr int kK = protocol::kMaxTopK;
constexpr int kChunk = kDispatchChunk;  // channels per dispatch work item: 16 per lane
constexpr int kCopyRegs = 16;           // 16-byte registers per lane a warp copy keeps in flight: 8 KiB per warp pass

// ------------------------------------------------------------------------------------------ memory model

// Signal words: protocol::LoadAcquireSys / StoreReleaseSys (runtime/protocol/sys_order.h).
__device__ __forceinline__ void FenceSys() { gpu::FenceAcqRelSys(); }
/// Orders a message's stores before its completion add (AddDone). The publisher acquires the completion counter at GPU
/// scope and releases the destination's signal at system scope; the receiver acquires that signal at system scope. A
/// release/acquire chain orders what its first release covers for the chain's last acquire whatever the scopes of its
/// links, each link being between threads its scope includes (PTX memory model: causality order is transitive). So a
/// message to an NVLink peer needs only a GPU-scope fence here, the system-scope one being the publisher's, once per
/// destination; DeepEP's NVLink path counts its messages the same way. A message staged for the CPU proxy is read by
/// a host thread after its command: system scope.
__device__ __forceinline__ void FenceBeforeCount(bool to_proxy) {
  if (to_proxy) {
    FenceSys();
  } else {
    gpu::FenceAcqRelGpu();
  }
}
__device__ __forceinline__ uint64_t NowNs() { return gpu::GlobalTimerNs(); }
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
  return reinterpret_cast<uint8_t*>(gpu::WarpShfl(reinterpret_cast<unsigned long long>(lane_peer), r));
}

/// Diagnostic timeline stamp (ll_kernels.h TracePoint) by the calling thread; one predictable branch when off.
__device__ __forceinline__ void TraceThis(const LlDeviceContext& c, LlOp op, TracePoint point) {
  // CTA-major ([num_ctas][2 ops][kTracePoints]): a receive-only launch may run fewer CTAs (ReceiveOnlyCtas).
  if (c.trace != nullptr) {
    c.trace[(blockIdx.x * protocol::kNumLlOps + static_cast<int>(op)) * kTracePoints + point] = NowNs();
  }
}
/// The same by thread 0 of the CTA.
__device__ __forceinline__ void Trace(const LlDeviceContext& c, LlOp op, TracePoint point) {
  if (threadIdx.x == 0) TraceThis(c, op, point);
}

// A warp copy pass: kRegs 16-byte registers per lane (kCopyRegs unless a phase needs its registers for more), all
// loads of a pass in flight together. Word i of lane l is at i * 512 + 16 l, copied while within the pass's `bytes`
// (< 2^31): one 32-bit compare per word, no 64-bit offsets, and a register past the end is neither loaded nor stored
// (not zero-filled). Neutral in time against the 64-bit form (bench/RESULTS.md session 24).
constexpr int64_t kCopyPassBytes = kCopyRegs * 512;

template <int kRegs>
__device__ __forceinline__ void LoadCopyPass(const uint8_t* src, int bytes, uint4 (&v)[kRegs]) {
  const int lane = threadIdx.x % 32, limit = bytes - lane * 16;
  src += lane * 16;
#pragma unroll
  for (int i = 0; i < kRegs; ++i) {
    if (i * 512 < limit) v[i] = Ld16(src + i * 512);
  }
}

template <int kRegs>
__device__ __forceinline__ void StoreCopyPass(uint8_t* dst, int bytes, const uint4 (&v)[kRegs]) {
  const int lane = threadIdx.x % 32, limit = bytes - lane * 16;
  dst += lane * 16;
#pragma unroll
  for (int i = 0; i < kRegs; ++i) {
    if (i * 512 < limit) St16(dst + i * 512, v[i]);
  }
}

// ------------------------------------------------------------------------------------------ errors

/// The `seq` of work a phase does before its call state is known (CallGate::Open, ll_kernels.cu): device sequence
/// numbers are >= 4 (protocol::DeviceCallSeq), so 1 is never a call.
constexpr uint32_t kSeqPending = 1;

/// An error found before the call state was known: the CTA keeps the first one and records it with the call's
/// sequence number once that is known (dropped if the launch turns out refused or aborted: it did nothing).
struct PendingError {
  uint32_t code;  ///< 0 = none (thread 0 clears it as the CTA starts)
  uint32_t op;
  int32_t peer;
  int64_t detail;
};
__shared__ PendingError g_pending_error;

/// RecordError's body, out of line: errors are rare, and inlined at each of the dozens of call sites (many in unrolled
/// per-slot loops) it made the kernels ~15 % larger, code a receive launch fetches cold (fast_div.h). Scalars only, so
/// the call does not copy the context to the stack. timeouts: the metrics word counting timeouts of `op`, or null.
__device__ __noinline__ void RecordErrorOutOfLine(uint32_t* flags, protocol::DeviceErrorRecords* errors,
                                                  unsigned long long* timeouts, uint32_t code, uint32_t op, int peer,
                                                  uint32_t seq, int64_t detail) {
  if (seq == kSeqPending) {
    if (atomicCAS(&g_pending_error.code, 0u, code) == 0u) {
      g_pending_error.op = op;
      g_pending_error.peer = peer;
      g_pending_error.detail = detail;
    }
    return;
  }
  // The first error of each severity keeps its record (DeviceErrorRecords). The thread that aborts the buffer owns
  // the fatal record and counts a timeout (metrics): once, however many CTAs and sources time out.
  const bool fatal = !protocol::DeviceErrorIsRecoverable(code);
  if (atomicExch(&flags[fatal ? 1 : 0], 1u) != 0u) return;
  if (code == protocol::kDeviceTimeout && timeouts != nullptr) atomicAdd(timeouts, 1ull);
  volatile protocol::DeviceErrorRecord* e = fatal ? &errors->fatal : &errors->recoverable;
  e->op = op;
  e->peer = peer;
  e->seq = seq;
  e->detail = detail;
  __threadfence_system();
  e->code = code;
  __threadfence_system();
}

__device__ __forceinline__ void RecordError(const LlDeviceContext& c, uint32_t code, LlOp op, int peer, uint32_t seq,
                                            int64_t detail) {
  unsigned long long* timeouts =
      c.metrics == nullptr
          ? nullptr
          : reinterpret_cast<unsigned long long*>(c.metrics + c.metrics_layout.timeouts(static_cast<int>(op)));
  RecordErrorOutOfLine(c.flags, c.errors, timeouts, code, static_cast<uint32_t>(op), peer, seq, detail);
}

__device__ __forceinline__ bool Aborted(const LlDeviceContext& c) {
  return *reinterpret_cast<volatile const uint32_t*>(&c.flags[1]) != 0u;
}

// ------------------------------------------------------------------------------------------ proxy peers

/// Whether the buffer has proxy peers (HasProxy) / rank masking on (HasMask): false by construction in the
/// NVLink-only compilations (LLEP_LL_NVLINK_ONLY, ll_kernels_nvlink.cu), which the launchers pick for a buffer with
/// neither, so that those kernels carry none of the proxy's and the masking's code in line on their paths
/// (kernels/SMALL_T_CODE.md: a jump over in-line code costs a fetch from far away). Every test of either in the device
/// code goes through these (tests/lint/check_config_branches.py).
#if defined(LLEP_LL_NVLINK_ONLY)
constexpr bool kProxyOrMaskCompiled = false;
#else
constexpr bool kProxyOrMaskCompiled = true;
#endif
__device__ __forceinline__ bool HasProxy(const LlDeviceContext& c) {
  return kProxyOrMaskCompiled && c.proxy_region != nullptr;
}
__device__ __forceinline__ bool HasMask(const LlDeviceContext& c) { return kProxyOrMaskCompiled && c.mask != nullptr; }

/// Rank r is reached through the proxy (no mapped region). One load, skipped when the buffer has no proxy peers.
__device__ __forceinline__ bool IsProxyPeer(const LlDeviceContext& c, int r) {
  return HasProxy(c) && c.peers[r] == nullptr;
}

/// The region a source's signal and data arrive in: proxy sources deliver into proxy_region (ll_kernels.h).
__device__ __forceinline__ const uint8_t* SrcBase(const LlDeviceContext& c, int src) {
  return IsProxyPeer(c, src) ? c.proxy_region : c.local;
}

/// Pushes a command for proxy peer `dst`; the caller fenced (system scope) the staged bytes it names. A push that
/// finds the proxy stopped records protocol::kDeviceProxyFailed and returns (the operation times out on its peers).
__device__ void PushCmd(const LlDeviceContext& c, int dst, const protocol::FifoCmd& cmd, LlOp op, uint32_t seq) {
  if (!protocol::FifoPush(c.fifos[dst], cmd)) RecordError(c, protocol::kDeviceProxyFailed, op, dst, seq, 0);
}

/// Warp-collective PushCmd (converged warp): every lane with `active` pushes `cmd` for proxy peer `dst`. Lanes whose
/// peers share a ring (one proxy thread serves many peers) push together with one claim atomic and one release store
/// instruction (protocol::FifoPushWarp), a group per ring.
__device__ void PushCmdWarp(const LlDeviceContext& c, int dst, const protocol::FifoCmd& cmd, bool active, LlOp op,
                            uint32_t seq) {
  const protocol::FifoRingHandle* h = active ? &c.fifos[dst] : nullptr;
  const unsigned long long ring = active ? reinterpret_cast<unsigned long long>(h->ring) : 0ull;
  for (unsigned pending = gpu::WarpBallot(active); pending != 0;) {
    const unsigned long long group = gpu::WarpShfl(ring, __ffs(pending) - 1);
    const bool mine = active && ring == group && ((pending >> (threadIdx.x % 32)) & 1u);
    const protocol::FifoRingHandle handle = mine ? *h : protocol::FifoRingHandle{};
    if (!protocol::FifoPushWarp(handle, cmd, mine) && mine)
      RecordError(c, protocol::kDeviceProxyFailed, op, dst, seq, 0);
    pending &= ~gpu::WarpBallot(mine);
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

/// *p = now, a plain store: the end stamps several CTAs contribute to (the receive's working CTAs, the send's
/// publishers). The word keeps the store that reached memory last: the latest end, unless two CTAs ended within the
/// stores' flight time of each other (then one of those two ends). Not an atomic max: a launch ends only once its last
/// atomic has completed, and that cost every receive launch 0.15-0.25 us with metrics on, however few CTAs reduced
/// (bench/RESULTS.md sessions 45 and 48).
__device__ __forceinline__ void StampLatest(uint64_t* p) { *reinterpret_cast<volatile uint64_t*>(p) = NowNs(); }

/// Bins the latencies of the operation in stamp slot i if its receive phase was started by a launch before this one
/// (so it finished: stream order) and it is not call `except` (the caller's own). A slot qualifies when its owner's
/// send and receive both stamped it (recv_seq == seq) and it is not binned yet. Stamps that do not make sense (an
/// operation cut short by an error) are dropped rather than binned. The slot's words load together, all used before
/// the first branch: one round trip. (One thread walking the four slots, each slot's loads after the previous slot's
/// check, held the binning CTA's plan until 4.4-4.5 us of a 6 us receive at T <= 8, 3.5 us with this: RESULTS s28.)
__device__ __forceinline__ void BinFinishedOp(const LlDeviceContext& c, int i, uint32_t except) {
  OpStamps& slot = c.stamps[i];
  const auto* w = reinterpret_cast<const unsigned long long*>(&slot);
  static_assert(offsetof(OpStamps, seq) == 40 && offsetof(OpStamps, op) == 48, "7 words: 5 stamps, seq|state, op|rs");
  const uint64_t s0 = gpu::LoadCg(w), s1 = gpu::LoadCg(w + 1), r0 = gpu::LoadCg(w + 2), w1 = gpu::LoadCg(w + 3),
                 r1 = gpu::LoadCg(w + 4), seq_state = gpu::LoadCg(w + 5), op_rseq = gpu::LoadCg(w + 6);
  const uint32_t seq = protocol::LowHalf(seq_state), state = protocol::HighHalf(seq_state);
  const uint32_t op = protocol::LowHalf(op_rseq), recv_seq = protocol::HighHalf(op_rseq);
  const uint64_t ns[protocol::kNumMetricPhases] = {s1 - s0, w1 - r0, r1 - s0};
  if (state != kStampSent || recv_seq != seq || seq == except) return;
  slot.state = kStampBinned;
  if (s1 < s0 || w1 < r0 || r1 < w1 || r1 < s0) return;
  protocol::AddOpLatencies(c.metrics_layout, static_cast<int>(op), ns,
                           [&](int word, uint64_t v) { AddMetric(c, word, v); });
}

/// Every slot's operation (BinFinishedOp), by one thread: the metrics flush kernel.
__device__ void BinFinishedOps(const LlDeviceContext& c, uint32_t except) {
  for (int i = 0; i < kStampSlots; ++i) BinFinishedOp(c, i, except);
}

/// Every source's signal seen (CTA 0, thread 0, after the CTA's wait).
__device__ __forceinline__ void StampWaitEnd(const LlDeviceContext& c, uint32_t seq) {
  if (c.metrics != nullptr && blockIdx.x == 0 && threadIdx.x == 0) StampSlot(c, seq).wait_end = NowNs();
}

/// The CTA's receive work is done (all threads, after it): thread 0 contributes the receive end if the CTA had receive
/// work (`worked`; the barrier either way, so that the kernel's control flow stays the same).
__device__ __forceinline__ void StampRecvEnd(const LlDeviceContext& c, uint32_t seq, bool worked) {
  if (c.metrics == nullptr) return;
  __syncthreads();
  if (threadIdx.x == 0 && worked) StampLatest(&StampSlot(c, seq).recv_end);
}

/// Send phase entered at `now` (one thread of CTA 0, once the call is known): the slot now belongs to call `seq`.
__device__ __forceinline__ void StampSendStart(const LlDeviceContext& c, LlOp op, uint32_t seq, uint64_t now) {
  if (c.metrics == nullptr || blockIdx.x != 0) return;
  OpStamps& st = StampSlot(c, seq);
  st.seq = seq;
  st.op = static_cast<uint32_t>(op);
  st.send_start = now;
  st.state = kStampSent;
}

/// Receive phase entered at `now` (one thread of CTA 0, once the call is known): two stores, no load. Checking the
/// slot's owner first was a dependent global round trip in the thread CTA 0's next barrier waits for (the combine
/// receive's token CTA: bench/RESULTS.md session 25); the binning checks instead. A slot that does not hold this call's
/// send stamps (only possible if more calls were in flight than the ring covers, which the host refuses) gets a
/// recv_seq that is not its owner's, so it is never binned: no latency is invented.
__device__ __forceinline__ void StampRecvStart(const LlDeviceContext& c, uint32_t seq, uint64_t now) {
  if (c.metrics == nullptr || blockIdx.x != 0) return;
  OpStamps& st = StampSlot(c, seq);
  st.recv_start = now;
  st.recv_seq = seq;
}

/// Whether this CTA (BinningCta) / thread (BinsMetrics) bins finished operations' latencies in a receive phase
/// (BinFinishedOp, once per launch, metrics on): the last kStampSlots threads (of the gate's warp, which holds no early
/// work) of CTA G-2, a slot each (ReceiveBinning). Not CTA 0, where receive work starts (tokens b, b + G, ...: CTA 0
/// binning cost 1.1 us of combine receive at T=1 on 4xH200), nor CTA G-1, which has its own serial work after the
/// signals (the dispatch's handle and table, the combine's count check) and ended small-T receives with the binning
/// before its barrier (bench/RESULTS.md sessions 22-25). With T < G CTA G-2 has no tokens.
/// After a send phase (a fused launch, `after_send`) CTA G-1 instead: CTA G-2 publishes rank 0's signal there
/// (FirstPublishedDst) and so starts its receive last, and binning after that made it the fused combine's last CTA at
/// T = 1 (recv_trace, one rank: 7.26 us, the other CTAs 5.66-6.72; bench/RESULTS.md session 59), while CTA G-1,
/// which publishes nothing, starts its receive early and bins while it waits for the signals (no peek there).
__device__ __forceinline__ bool BinningCta(const LlDeviceContext& c, bool after_send) {
  return c.metrics != nullptr && blockIdx.x == (gridDim.x >= 2 ? gridDim.x - (after_send ? 1 : 2) : 0);
}
__device__ __forceinline__ bool BinsMetrics(const LlDeviceContext& c, bool after_send) {
  return threadIdx.x >= kThreads - kStampSlots && BinningCta(c, after_send);
}
/// A receive phase's binning (the BinsMetrics threads; `seq` its own call, not binned).
__device__ __forceinline__ void ReceiveBinning(const LlDeviceContext& c, uint32_t seq, bool after_send) {
  if (BinsMetrics(c, after_send)) BinFinishedOp(c, static_cast<int>(threadIdx.x) - (kThreads - kStampSlots), seq);
}

}  // namespace
}  // namespace llep::kernels::cuda
