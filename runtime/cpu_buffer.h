// A rank of the CPU backend: owns the LL region, the proxy and its transports, and runs dispatch/combine with
// DeepEP V1 low-latency semantics on CPU threads. The first-class backend for GPU-less hosts and CI, and the
// oracle GPU tests compare against. Layer: runtime.
//
// Threading: send phases are serialised by a mutex; a receive phase may run on another thread (vLLM runs receive
// hooks from a second CPU thread) and holds the mutex only for bookkeeping, never while waiting. Proxy threads run
// inside. Each operation is split into a send phase and a receive phase (the receive-hook model): Send*() returns
// a PendingOp, Receive() completes it. Every send takes the next call sequence number; its parity picks the half.
//
// In-flight rule (as DeepEP's): at most two operations may hold buffer state. Locally, a send is refused while
// the operation two calls earlier (same half) is still unreceived. Across ranks, a dispatch must not be sent
// while any rank still holds the dispatch two calls earlier unreceived; a message overwritten that way is
// detected (sequence check) and reported as DataLoss instead of being read.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/host/ll_host.h"
#include "kernels/host/route_plan.h"
#include "proxy/proxy.h"
#include "runtime/base/env.h"
#include "runtime/bootstrap.h"
#include "runtime/call_sequence.h"
#include "runtime/host_region.h"
#include "runtime/protocol/ll_call.h"
#include "runtime/protocol/ll_layout.h"
#include "runtime/protocol/metrics_layout.h"

namespace llep {

struct CpuBufferOptions {
  /// libfabric provider for inter-process traffic ("shm", "tcp;ofi_rxm", ...); empty = "shm" (one host)
  std::string provider = "shm";
  int num_proxy_threads = 1;
  absl::Duration timeout = absl::Seconds(30);  ///< receive wait before DeadlineExceeded names the silent ranks
  proxy::ProxyOptions proxy;
  bool metrics = true;  ///< keep the metrics counter block (runtime/protocol/metrics_layout.h)
  int metrics_layers = base::kDefaultMetricsLayers;  ///< MoE layers counted apart; a dispatch's layer is below it
  /// Rank masking (DeepEP's enable_shrink): a source that stays silent for the timeout is masked instead of failing
  /// the receive (kernels/host/ll_host.h says what a masked rank means). Each peer then gets its own proxy thread
  /// (proxy::ProxyOptions::isolate_peer_failures), so a peer that dies inside the transport is masked too.
  bool shrink = false;
};

/// A sent operation waiting for its receive phase. Move-only; Receive() consumes it.
class PendingOp {
 public:
  // A moved-from PendingOp has seq 0 and is refused by Receive(), so an operation is received at most once.
  PendingOp(PendingOp&& o) noexcept { *this = std::move(o); }
  PendingOp& operator=(PendingOp&& o) noexcept {
    seq_ = o.seq_;
    op_ = o.op_;
    dispatch_ = o.dispatch_;
    combine_ = o.combine_;
    plan_ = std::move(o.plan_);
    send_start_ns_ = o.send_start_ns_;
    send_end_ns_ = o.send_end_ns_;
    wait_end_ns_ = o.wait_end_ns_;
    masked_ = std::move(o.masked_);
    barrier_ = o.barrier_;
    o.seq_ = 0;
    return *this;
  }
  uint32_t seq() const { return seq_; }
  protocol::LlOp op() const { return op_; }

 private:
  friend class CpuBuffer;
  PendingOp() = default;
  uint32_t seq_ = 0;
  protocol::LlOp op_ = protocol::LlOp::kDispatch;
  DispatchCall dispatch_;
  CombineCall combine_;
  std::unique_ptr<kernels::RoutePlan> plan_;  // combine: where each (token, slot) row comes back
  uint64_t send_start_ns_ = 0;                // metrics: the send phase's steady-clock span
  uint64_t send_end_ns_ = 0;
  uint64_t wait_end_ns_ = 0;
  std::vector<uint8_t> masked_;  // shrink: the mask as the receive phase sees it (empty otherwise)
  bool barrier_ = false;         // Clean()'s empty dispatch: not counted in the metrics
};

class CpuBuffer {
 public:
  /// Collective: allocates the region, starts proxy threads, exchanges endpoints through `bootstrap`.
  static absl::StatusOr<std::unique_ptr<CpuBuffer>> Create(const protocol::LlShape& shape, Bootstrap& bootstrap,
                                                           const CpuBufferOptions& options);
  ~CpuBuffer();

  absl::StatusOr<PendingOp> DispatchSend(const DispatchCall& call);
  absl::StatusOr<PendingOp> CombineSend(const CombineCall& call);
  /// Waits (up to the timeout) for every source's signal and unpacks / reduces into the call's outputs.
  absl::Status Receive(PendingOp op);

  /// bf16 [E/R, R*T, row_stride] staging of the half the next call uses (DeepEP zero-copy combine buffer).
  uint16_t* NextCombineBuffer() const;
  /// Elements between consecutive rows of NextCombineBuffer() (H + H/64 for H % 512 == 0, as DeepEP).
  int64_t combine_buffer_row_stride() const { return layout_.combine_stride / 2; }

  /// Collective: barrier, then stop the proxy. Call before destruction so no peer still writes into us. With ranks
  /// masked (shrink) there is no barrier: the masked ones may be dead.
  absl::Status Close();

  /// Rank masking (options.shrink; DeepEP's low_latency_{update,query,clean}_mask_buffer). Masks()[r] is 1 when r is
  /// masked: by SetMasked, by a receive that timed out waiting for it, or because its proxy thread failed.
  bool shrink() const { return options_.shrink; }
  /// Collective over the unmasked ranks (clean_low_latency_buffer): returns the buffer to a usable state after a
  /// failed call. Shrink: a barrier through the buffer itself (an empty dispatch), so a rank silent for the timeout
  /// is masked, not waited on. Otherwise every rank must join: the ranks agree through the bootstrap on the newest
  /// call sequence number any of them took and all continue after it (a rank that gave up a call re-aligns), and
  /// operations left unreceived are abandoned. Fails (as the calls do) if the proxy itself failed.
  absl::Status Clean();
  absl::Status SetMasked(int rank, bool masked);
  std::vector<int32_t> Masks() const;
  void ClearMasks();

  const protocol::LlLayout& layout() const { return layout_; }
  int rank() const { return rank_; }
  std::string transport_name() const { return transport_name_; }
  proxy::ProxyStats proxy_stats() const;

  /// Metrics (options.metrics): the counter block's layout (num_words() == 0 when off) and a copy of it. Each
  /// operation is counted when its receive phase ends; the latencies use the steady clock (metrics_layout.h).
  protocol::MetricsLayout metrics_layout() const { return metrics_layout_; }
  std::vector<uint64_t> MetricsSnapshot() const;

 private:
  CpuBuffer(const protocol::LlLayout& layout, Bootstrap& bootstrap, const CpuBufferOptions& options);
  absl::Status Init();
  void StopProxy();
  absl::StatusOr<uint32_t> BeginSend(protocol::LlOp op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status WaitForSignals(PendingOp& op, std::vector<uint32_t>* values, int64_t* wait_stats);
  absl::Status ReceiveDispatch(PendingOp& op);
  absl::Status ReceiveCombine(PendingOp& op);
  kernels::HostRankContext Context(const std::vector<uint8_t>* masked = nullptr) const;
  /// shrink: masks the peers whose proxy thread failed, then copies the mask (empty when not shrinking).
  std::vector<uint8_t> MaskForCall();
  void AddMetrics(const std::function<void(std::vector<uint64_t>&)>& f);

  protocol::LlLayout layout_;
  Bootstrap& bootstrap_;
  CpuBufferOptions options_;
  int rank_;
  HostRegion region_;
  proxy::ProxyPtr proxy_;
  std::vector<kernels::HostPeer> peers_;
  std::string transport_name_;
  mutable absl::Mutex mu_;
  CallSequence calls_ ABSL_GUARDED_BY(mu_);                // sequence numbers and the in-flight rule
  kernels::RoutePlan dispatch_plan_ ABSL_GUARDED_BY(mu_);  // reused across dispatches (send phase only)
  // The last dispatch of each buffer half (kernels/EXPERT_SIDE_COMBINE.md; the GPU backend's ExpertPlanArea and
  // CarriedPlanArea keep the same), by plan key, 0 when it carried no combine_weights: as expert rank the messages it
  // received (its combine reduces them), as home rank the weights it sent (its combine's topk_weights must equal them,
  // bit for bit).
  struct KeptWeights {
    uint64_t plan_key = 0;
    std::vector<float> w;
  };
  std::array<kernels::ExpertSidePlan, 2> expert_plans_ ABSL_GUARDED_BY(mu_);
  std::array<KeptWeights, 2> sent_weights_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  protocol::MetricsLayout metrics_layout_;
  mutable absl::Mutex metrics_mu_;
  std::vector<uint64_t> metrics_ ABSL_GUARDED_BY(metrics_mu_);  // the counter block; empty when off
  // shrink: [num_ranks], 1 = masked. Atomics: receive phases (on any thread, without mu_) mask silent sources.
  std::unique_ptr<std::atomic<int32_t>[]> masks_;
};

}  // namespace llep
