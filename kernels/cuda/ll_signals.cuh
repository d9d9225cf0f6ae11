// The signal protocol of the low-latency kernels: waiting for a call's sources (agreeing on a lost one, peeking before
// the gate), counting a destination's messages done and publishing its signal. Part of the kernels' device code, on
// ll_device_common.cuh (included by ll_call_gate.cuh, which every phase includes; each part reopens the same private
// namespace), split from it so that each file is one a reader can hold.
#pragma once

#include "kernels/cuda/ll_device_common.cuh"

namespace llep::kernels::cuda {
namespace {

/// Waits for `p` to carry call `seq`; returns its value, or -1 after recording a timeout / overrun (or when
/// another CTA already aborted). `waited` receives the time spent. With rank masking (c.mask) a timeout is not
/// recorded: -2 is returned and the caller masks the source.
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
      RecordError(c, protocol::kDeviceSequenceOverrun, op, src, seq, s);
      return -1;
    }
    if ((spin & 255u) == 255u) {
      if (Aborted(c)) return -1;
      if (NowNs() - t0 > c.timeout_ns) {
        *waited = static_cast<int64_t>(NowNs() - t0);
        if (HasMask(c)) return -2;
        RecordError(c, protocol::kDeviceTimeout, op, src, seq, static_cast<int64_t>(c.timeout_ns));
        return -1;
      }
    }
  }
}

/// Rank masking: the receive's decision on source `src` of call `seq` (its signal value, or kMaskedVerdict), shared by
/// every CTA. Each CTA proposes what it saw (the value, or masked when the source was masked already or it timed out)
/// and the first proposal for the call wins: without it one CTA could time out a source whose signal another CTA read
/// just in time, and the CTAs would lay the received rows out differently. One atomic per (CTA, source), only with
/// masking on. The winner of a masked verdict masks the source and, when its CTA timed out (`timed_out`: the source
/// was not masked before the call), counts the timeout.
__device__ uint32_t AgreeOnSource(const LlDeviceContext& c, LlOp op, int half, int src, uint32_t seq, uint32_t mine,
                                  bool timed_out) {
  unsigned long long* v =
      c.verdicts + (half * protocol::kNumLlOps + static_cast<int>(op)) * c.layout.shape.num_ranks + src;
  const unsigned long long proposal = protocol::PackSignal(seq, mine);
  unsigned long long seen = gpu::LoadCg(v);
  while (protocol::SignalSeq(seen) != seq) {
    const unsigned long long prev = atomicCAS(v, seen, proposal);
    if (prev == seen) {
      if (mine == kMaskedVerdict) {
        atomicExch(c.mask + src, 1);
        if (timed_out && c.metrics != nullptr) AddMetric(c, c.metrics_layout.timeouts(static_cast<int>(op)), 1);
      }
      return mine;
    }
    seen = prev;
  }
  return protocol::SignalValue(seen);
}

/// Signal words a receive-only launch read before it knew its call (PeekSignals): [half][src], NVLink sources < 32.
constexpr int kMaxPeekedSources = 32;
__shared__ uint64_t g_peeked_signals[protocol::kNumHalves][kMaxPeekedSources];

/// A receive-only launch usually runs after its send finished on every rank (a hook), so the signals it waits for are
/// there already, and reading them is a global round trip that need not wait for the call state: warps 13 and 14
/// (idle while the others plan: work is dealt from warp 0, and warp 15 reads the call state) read the two halves'
/// signal words of every source, a thread per (half, source) so the acquire loads are in flight together, before
/// the gate opens. Returns whether they did (every source an NVLink peer, R <= 32); the words are visible to the CTA
/// after the gate's barrier, and WaitAllSources starts from them.
__device__ __forceinline__ bool PeekSignals(const LlDeviceContext& c, LlOp op) {
  const int R = c.layout.shape.num_ranks;
  if (HasProxy(c) || R > kMaxPeekedSources) return false;
  const int lane = threadIdx.x % 32, h = threadIdx.x / 32 - (kWarps - 3);
  if (h >= 0 && h < protocol::kNumHalves && lane < R) {
    g_peeked_signals[h][lane] =
        protocol::LoadAcquireSys(reinterpret_cast<const uint64_t*>(c.local + c.layout.SignalOffset(h, op, lane)));
  }
  return true;
}

/// After the gate opened a launch whose PeekSignals ran: whether the peek found every source's signal of call `seq`,
/// with a value of at most max_value, so there is nothing to wait for. Warp-collective; every warp reads the same
/// shared words after the gate's barrier, so the answer is the same in the whole CTA.
__device__ __forceinline__ bool AllSignalsPeeked(const LlDeviceContext& c, int half, uint32_t seq, int64_t max_value) {
  const int lane = threadIdx.x % 32;
  bool ok = true;
  if (lane < c.layout.shape.num_ranks) {
    const uint64_t w = g_peeked_signals[half][lane];
    ok = protocol::SignalSeq(w) == seq && protocol::SignalValue(w) <= max_value;
  }
  return !gpu::WarpAny(!ok);
}

/// The receive phases' wait: the CTA's threads wait for every source's signal of call `seq`, store each value
/// (0 on failure) in values[src], set *failed on a timeout, overrun or a value above max_value (recorded), and
/// CTA 0 adds the waiting time to wait_stats[src] (ns). With `peeked`, a signal PeekSignals found is not read again.
/// With rank masking a masked source is not waited for, a silent one is masked (AgreeOnSource), and values[src] is -1
/// for both. The caller synchronises the CTA before reading values.
__device__ void WaitAllSources(const LlDeviceContext& c, LlOp op, int half, uint32_t seq, int64_t max_value,
                               int64_t* wait_stats, int* values, int* failed, bool peeked, bool after_send) {
  // Metrics: the binning CTA's threads bin earlier operations' latencies meanwhile (BinsMetrics), and CTA 0 accounts
  // the waits.
  ReceiveBinning(c, seq, after_send);
  for (int src = threadIdx.x; src < c.layout.shape.num_ranks; src += kThreads) {
    int64_t waited = 0;
    int64_t v;
    const bool masked_before = HasMask(c) && *reinterpret_cast<volatile const int32_t*>(c.mask + src) != 0;
    if (masked_before) {
      v = -2;  // not waited on
    } else if (IsProxyPeer(c, src)) {
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
    } else if (peeked && protocol::SignalSeq(g_peeked_signals[half][src]) == seq) {
      v = protocol::SignalValue(g_peeked_signals[half][src]);  // the peek's acquire ordered this CTA's later reads
    } else {
      v = WaitSignal(c, reinterpret_cast<const uint64_t*>(c.local + c.layout.SignalOffset(half, op, src)), op, src, seq,
                     &waited);
    }
    if (HasMask(c) && v != -1) {
      const uint32_t agreed = AgreeOnSource(c, op, half, src, seq, v == -2 ? kMaskedVerdict : static_cast<uint32_t>(v),
                                            v == -2 && !masked_before);
      v = agreed == kMaskedVerdict ? -2 : int64_t{agreed};
    }
    if (v > max_value) RecordError(c, protocol::kDeviceBadMessage, op, src, seq, v);
    const bool ok = v >= 0 && v <= max_value;
    if (!ok && v != -2) *failed = 1;
    values[src] = ok ? static_cast<int>(v) : (v == -2 ? -1 : 0);
    if (blockIdx.x == 0 && wait_stats != nullptr) {
      atomicAdd(reinterpret_cast<unsigned long long*>(&wait_stats[src]), static_cast<unsigned long long>(waited));
    }
    if (blockIdx.x == 0 && c.metrics != nullptr) {
      AddMetric(c, c.metrics_layout.recv_wait_ns(static_cast<int>(op), src), static_cast<uint64_t>(waited));
    }
  }
}

/// The receive phases' signals (CTA-wide: every thread calls it): WaitAllSources, or, when the peek found every
/// source's signal of call `seq` within max_value and no rank is masked (a hook's receive, usually), the peeked values
/// without entering it (nothing was waited for: no wait statistics to add). WaitAllSources's path for a peeked signal
/// jumps over its masking, proxy and polling code, each jump to cold instructions: in the combine receive thread 0
/// spent 1.2 us in it at T=1 and 2.4 us at T=128 with every signal peeked (recv_trace, bench/RESULTS.md session 23).
/// The metrics binning runs either way (`after_send`: the launch ran a send phase, BinningCta).
__device__ __forceinline__ void ReceiveSignals(const LlDeviceContext& c, LlOp op, int half, uint32_t seq,
                                               int64_t max_value, int64_t* wait_stats, int* values, int* failed,
                                               bool peeked, bool after_send) {
  if (peeked && !HasMask(c) && AllSignalsPeeked(c, half, seq, max_value)) {
    for (int src = threadIdx.x; src < c.layout.shape.num_ranks; src += kThreads) {
      values[src] = static_cast<int>(protocol::SignalValue(g_peeked_signals[half][src]));
    }
    ReceiveBinning(c, seq, after_send);
    return;
  }
  WaitAllSources(c, op, half, seq, max_value, wait_stats, values, failed, peeked, after_send);
}

// Completion of an operation towards one destination: a 64-bit counter per (half, op, dst) (LlDeviceContext::done)
// gets one fire-and-forget add per message (or message part), each after its sender's fence (FenceBeforeCount); the CTA
// that knows the count polls until it reads all adds, publishes the signal word (message count n) with a release store
// and resets the counter for the next call on this half (stream-ordered after this launch). Measured against "the add
// that completes the count publishes": equal at T=128, 2.7 us faster at T=1 (senders never wait).
__device__ __forceinline__ void AddDone(const LlDeviceContext& c, LlOp op, int half, int dst) {
  atomicAdd(reinterpret_cast<unsigned long long*>(
                c.done + (half * protocol::kNumLlOps + static_cast<int>(op)) * c.layout.shape.num_ranks + dst),
            1ull);
}

/// The first destination whose signal this CTA publishes in a send phase (then every G-th): CTA G-2-d publishes
/// rank d's (the dispatch's counting CTA of d is the same CTA), CTA G-1 only ranks d = G-1, 2G-1, ... (none below G
/// ranks). CTA G-1 has the receive phase's serial work after the signals (the dispatch's handle and table, the
/// combine's count check), and a publisher starts its receive phase only after its signal is out: with both on one
/// CTA it was a fused launch's last CTA at T = 1 (recv_trace, one rank: the dispatch's ended 8.5 us, where the CTAs
/// with the items ended at 6.2-7.8; the combine's 7.4-7.7, a tokenless CTA 5.3-5.5; bench/RESULTS.md session 57).
__device__ __forceinline__ int FirstPublishedDst(int G) {
  const int d = G - 2 - static_cast<int>(blockIdx.x);
  return d < 0 ? d + G : d;
}

/// `weights_rows`: a proxy destination's dispatch route block carries its messages' weights rows (a second write).
__device__ void PublishWhenDone(const LlDeviceContext& c, LlOp op, int half, int dst, uint32_t n, uint32_t seq,
                                uint32_t adds, bool weights_rows) {
  uint64_t* ctr = c.done + (half * protocol::kNumLlOps + static_cast<int>(op)) * c.layout.shape.num_ranks + dst;
  // The peer's base is loaded before the poll: after the acquire it would be one more dependent load between the
  // last completion add and the signal store.
  uint8_t* const peer = c.peers[dst];
  const uint64_t t0 = NowNs();
  for (uint32_t spin = 0;; ++spin) {
    if (gpu::LoadAcquireGpu(ctr) == adds) break;
    if ((spin & 255u) == 255u && (Aborted(c) || NowNs() - t0 > c.timeout_ns)) {
      RecordError(c, protocol::kDeviceTimeout, op, c.rank, seq, -1);  // local: a CTA of this launch never finished
      return;
    }
  }
  TraceThis(c, op, kTracePolled);
  if (!HasProxy(c) || peer != nullptr) {
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
      if (weights_rows && n > 0) {
        PushCmd(c, dst,
                protocol::MakeWriteCmd(op, half, dst, L.RouteWeightsOffset(L.RouteSendOffset(half, dst), 0),
                                       L.RouteWeightsOffset(L.RouteRecvOffset(half, c.rank), 0),
                                       int64_t{n} * protocol::RouteWeightsRowBytes()),
                op, seq);
      }
    }
    PushCmd(c, dst, protocol::MakeSignalCmd(op, half, dst, protocol::PackSignal(seq, n)), op, seq);
  }
  // Reset for the next call on this half (stream-ordered after this launch). After the signal: the release store
  // above orders this thread's earlier writes, and a reset before it would be one more of them to wait for.
  *ctr = 0;
  if (c.metrics != nullptr) StampLatest(&StampSlot(c, seq).send_end);
  TraceThis(c, op, kTracePublished);
}

}  // namespace
}  // namespace llep::kernels::cuda
