// The metrics counter block: per-expert receive statistics, per-rank traffic, receive waits and latency
// histograms, counted by the backends themselves (the CUDA kernels on the device, the CPU backend on its threads)
// and read by metrics/ (the collector and the Prometheus exporter). Layer: runtime/protocol (depends on nothing).
//
// Producers and consumers:
//  - The block is an array of uint64 words, every word a monotonic counter (never reset: consumers take deltas, so
//    CUDA-graph replay keeps counting with no host work per call). The GPU backend keeps it in device memory and
//    adds with fire-and-forget atomics; the CPU backend keeps it in host memory under a mutex.
//  - The collector copies the whole block (GPU: an async copy on a side stream) and reads it as one snapshot. Words
//    are updated independently, so a snapshot taken while an operation runs may show its tokens before its
//    histogram entry; every word is individually exact, and each is complete once the operation's latency has
//    been binned.
//
// Latency phases of one operation (dispatch or combine), all from one clock (GPU: %globaltimer):
//   send      = send phase start .. the last signal of this rank published;
//   recv_wait = receive phase start .. every source's signal seen;
//   total     = send phase start .. receive phase done (with receive hooks this includes the caller's work
//               between the two launches: it is the operation's latency as the decode step sees it).
#pragma once

#include <cstdint>

#include "runtime/protocol/hd.h"

namespace llep::protocol {

inline constexpr uint32_t kMetricsLayoutVersion = 2;  // 2: expert receive counts per (layer, local expert)

/// Phases of an operation's latency histogram (see above).
enum MetricPhase : int { kMetricSend = 0, kMetricRecvWait = 1, kMetricTotal = 2, kNumMetricPhases = 3 };

/// Latency histogram buckets: upper bounds in ns (Prometheus `le`), microsecond scale because LL operations take
/// 5 µs .. 1 ms; one more bucket counts everything above the last bound (+Inf).
inline constexpr int kLatencyBounds = 20;
inline constexpr int kLatencyBuckets = kLatencyBounds + 1;

LLEP_HD constexpr uint64_t LatencyBoundNs(int i) {
  constexpr uint64_t kUs[kLatencyBounds] = {5,   10,  20,  30,  40,  50,  60,  80,   100,  125,
                                            150, 200, 250, 300, 400, 500, 750, 1000, 2000, 5000};
  return kUs[i] * 1000;
}

/// The bucket of a latency: the first bound >= ns, or kLatencyBounds for +Inf.
LLEP_HD constexpr int LatencyBucket(uint64_t ns) {
  int b = 0;
  while (b < kLatencyBounds && ns > LatencyBoundNs(b)) ++b;
  return b;
}

/// Word offsets of the counter block for one buffer shape (R ranks, E_loc local experts) and L MoE layers (the
/// `layer` a dispatch names: engines share one buffer across layers, and expert placement needs each layer's load).
/// Ops are indexed by LlOp (0 dispatch, 1 combine).
struct MetricsLayout {
  int num_ranks = 0;
  int num_local_experts = 0;
  int num_layers = 1;

  static constexpr int kOps = 2;
  /// Operations whose latency was binned, per op.
  LLEP_HD constexpr int ops(int op) const { return op; }
  /// Receive phases that ended with a timeout (a silent peer), per op.
  LLEP_HD constexpr int timeouts(int op) const { return kOps + op; }
  /// Histogram bucket counts (not cumulative), per op and phase.
  LLEP_HD constexpr int latency_bucket(int op, int phase, int bucket) const {
    return 2 * kOps + (op * kNumMetricPhases + phase) * kLatencyBuckets + bucket;
  }
  /// Sum of the binned latencies in ns, per op and phase.
  LLEP_HD constexpr int latency_sum_ns(int op, int phase) const {
    return 2 * kOps + kOps * kNumMetricPhases * kLatencyBuckets + op * kNumMetricPhases + phase;
  }
  /// ns the receive phase waited for source `src`'s signal (DeepEP's wait_recv_cost_stats, accumulated).
  LLEP_HD constexpr int recv_wait_ns(int op, int src) const { return latency_sum_ns(kOps, 0) + op * num_ranks + src; }
  /// (token, expert) selections this rank's dispatches sent to rank `dst` (its own rank included).
  LLEP_HD constexpr int sent_selections(int dst) const { return recv_wait_ns(kOps, 0) + dst; }
  /// Tokens this rank's dispatches of MoE layer `layer` received for local expert `le` (the sum of recv_count over
  /// those calls), [layer][le].
  LLEP_HD constexpr int expert_recv_tokens(int layer, int le) const {
    return sent_selections(num_ranks) + layer * num_local_experts + le;
  }
  /// Words in the block.
  LLEP_HD constexpr int num_words() const { return expert_recv_tokens(num_layers, 0); }
  LLEP_HD constexpr int64_t num_bytes() const { return int64_t{num_words()} * 8; }
};

LLEP_HD constexpr MetricsLayout ComputeMetricsLayout(int num_ranks, int num_local_experts, int num_layers = 1) {
  return MetricsLayout{num_ranks, num_local_experts, num_layers};
}

/// Records one finished operation's latencies (ns, per MetricPhase): calls add(word, value) for the op count, one
/// bucket and the sum per phase. The one definition of what an operation adds; `add` is the producer's primitive
/// (a device atomic, or a plain add under the CPU backend's mutex).
template <typename Add>
LLEP_HD void AddOpLatencies(const MetricsLayout& m, int op, const uint64_t (&ns)[kNumMetricPhases], Add&& add) {
  add(m.ops(op), uint64_t{1});
  for (int ph = 0; ph < kNumMetricPhases; ++ph) {
    add(m.latency_bucket(op, ph, LatencyBucket(ns[ph])), uint64_t{1});
    add(m.latency_sum_ns(op, ph), ns[ph]);
  }
}

}  // namespace llep::protocol
