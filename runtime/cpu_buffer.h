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

  /// Collective: barrier, then stop the proxy. Call before destruction so no peer still writes into us.
  absl::Status Close();

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
  kernels::HostRankContext Context() const;
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
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  protocol::MetricsLayout metrics_layout_;
  mutable absl::Mutex metrics_mu_;
  std::vector<uint64_t> metrics_ ABSL_GUARDED_BY(metrics_mu_);  // the counter block; empty when off
};

}  // namespace llep
