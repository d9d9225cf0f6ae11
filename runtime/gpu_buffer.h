// A rank of the GPU backend: the LL region in device memory, mapped into every NVLink peer with CUDA IPC, and the
// kernels of kernels/cuda/ll_kernels.h launched on the caller's stream. Layer: runtime.
//
// Peers on other nodes (other hosts, or virtual nodes of one host: runtime/topology.h) go through the CPU proxy: a
// pinned host region of the same layout, mapped into the GPU, is registered with the proxy's transports (libfabric
// or ibverbs); the kernels stage data there and push FIFO commands into pinned rings the proxy threads drain, and
// the receiving proxy publishes signals there after counting every announced write. Both kinds of peer are served
// by the same launch. GPU memory is never registered with the NIC today (host-staged path; dma-buf is the next step).
//
// Calls are stream-ordered and never synchronise with the device: a send returns once its kernel is queued. The
// kernels report bad input, protocol inconsistencies and silent peers through records in mapped host memory
// (protocol::DeviceErrorRecords, one per severity), turned into a Status:
//   - InvalidArgument for bad topk_idx / layout_range (the kernels treated them as "no expert" / "no rows"; the
//     buffer stays usable): raised by CheckErrors() only, which clears the record. The next call logs it once but
//     does not raise it: whether the kernel that recorded it has finished when the host makes that call is timing,
//     so ranks given the same bad input would raise at different calls, make different call sequences and time
//     each other out (the GPU bad-input catalogue did, bench/RESULTS.md session 15). The operation it concerns
//     already completed consistently on every rank; raising later would only break the collective.
//   - DeadlineExceeded / DataLoss / FailedPrecondition for a peer that did not answer in time, a sequence overrun or
//     a broken call-order rule: raised by every later call and by CheckErrors() (sticky: the device already refuses
//     every launch, so raising cannot desynchronise anything; every rank calls Clean() to reset it; with
//     options.shrink a silent peer is masked instead).
// A caller that must know a specific call's outcome synchronises its stream and calls CheckErrors().
//
// Graph safety: the kernels number the operations and pick the buffer half themselves (ll_kernels.h LlCallState), so
// any mix of eager calls and replays of captured graphs (any number of calls per graph, several graphs of different
// batch sizes on one buffer) stays consistent. No call synchronises the host, so every call may be captured.
//
// In-flight rules (runtime/call_sequence.h): at most two operations in flight, and a receive region is reused only
// once this rank sent and received another operation since its last receive (so every peer finished reading it).
// The host refuses a violating call in issue order (FailedPrecondition, as the CPU backend); the kernels check the
// same rules before their first store on every launch, where the host cannot see replays, and record a fatal
// kDeviceInFlight / kDeviceRegionBusy / kDeviceBadReceive (runtime/protocol/device_error.h; a hook replayed without a
// new replay of its send). All launches on one buffer must be ordered on one stream (or by events), as DeepEP requires.
// Results are written to the caller's tensors, so they stay valid after the half is reused; only the zero-copy staging
// is shared (see NextCombineBuffer).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/cuda/ll_kernels.h"
#include "proxy/proxy.h"
#include "runtime/base/env.h"
#include "runtime/bootstrap.h"
#include "runtime/call_sequence.h"
#include "runtime/cuda_fifo_ring.h"
#include "runtime/protocol/gpu_api.h"
#include "runtime/protocol/ll_call.h"
#include "runtime/protocol/ll_layout.h"
#include "runtime/topology.h"

namespace llep {

struct GpuBufferOptions {
  int device = -1;                             ///< CUDA device of this rank; -1 = the calling thread's current one
  absl::Duration timeout = absl::Seconds(30);  ///< receive wait per signal before the kernel records a timeout
  int num_ctas = 0;                            ///< CTAs per send launch (receives: ReceiveOnlyCtas); 0 = SMs
  bool kernel_trace = false;  ///< diagnostic timeline of the kernels (ll_kernels.h TracePoint); env LLEP_KERNEL_TRACE=1
  bool metrics = true;        ///< the kernels keep the metrics counter block (runtime/protocol/metrics_layout.h)
  int metrics_layers = base::kDefaultMetricsLayers;  ///< MoE layers counted apart; a dispatch's layer is below it
  /// Virtual nodes (runtime/topology.h): -1 = env LLEP_RANKS_PER_NODE, else by host; 0 = by host; N = consecutive
  /// groups of N ranks per node (1 = every peer through the proxy).
  int ranks_per_node = -1;
  /// Proxy transport (proxy/transport_factory.h): "ibverbs" or a libfabric provider; empty = env
  /// LLEP_FABRIC_PROVIDER, else "shm" when every proxy pair shares a host and an RDMA provider otherwise.
  std::string transport;
  int num_proxy_threads = 1;  ///< proxy threads (each with its own ring and transport); env LLEP_PROXY_THREADS
  /// Rank masking (DeepEP's enable_shrink): a source silent for the timeout is masked instead of failing the call
  /// (kernels/cuda/ll_kernels.h LlDeviceContext::mask). Covers NVLink peers; a proxy peer that fails still fails
  /// the proxy (the CPU backend isolates them: runtime/cpu_buffer.h).
  bool shrink = false;
};

/// A sent operation whose receive phase has not been launched yet (receive hooks). Copyable: the Python layer
/// shares it with the hook closure; Receive() accepts it once.
struct GpuPendingOp {
  uint32_t seq = 0;
  protocol::LlOp op = protocol::LlOp::kDispatch;
  kernels::cuda::DispatchParams dispatch;
  kernels::cuda::CombineParams combine;
  int recv_ctas = 0;  ///< the grid of its receive phase: ReceiveOnlyCtas for a hook's launch, else the buffer's
};

class GpuBuffer {
 public:
  /// Collective: allocates and zeroes the region, exchanges IPC handles through `bootstrap`, maps every peer.
  static absl::StatusOr<std::unique_ptr<GpuBuffer>> Create(const protocol::LlShape& shape, Bootstrap& bootstrap,
                                                           const GpuBufferOptions& options);
  ~GpuBuffer();

  /// Queues the dispatch: send and receive phases in one launch, or only the send phase when `split` (the
  /// receive phase is then launched by Receive(), the hook). Pointers are device pointers.
  absl::StatusOr<GpuPendingOp> Dispatch(const DispatchCall& call, bool split, cudaStream_t stream);
  /// The same for combine. call.zero_copy: rows were written into NextCombineBuffer().
  absl::StatusOr<GpuPendingOp> Combine(const CombineCall& call, bool split, cudaStream_t stream);
  /// Launches the receive phase of a split operation on `stream`.
  absl::Status Receive(const GpuPendingOp& op, cudaStream_t stream);

  /// Reads the kernels' error records (no device synchronisation). OK when no kernel reported anything. bad_input
  /// false: fatal errors only, as a call checks (file comment), e.g. before a graph replay.
  absl::Status CheckErrors(bool bad_input = true);

  /// bf16 [E/R, R*T, combine_row_stride] staging a zero-copy combine reads (DeepEP's zero-copy buffer). One fixed area
  /// for every call (ll_kernels.h kZeroCopyHalf), so a captured graph may hold its address; write it after the
  /// previous combine's send in stream order.
  uint16_t* NextCombineBuffer() const;
  int64_t combine_buffer_row_stride() const { return layout_.combine_stride / 2; }

  /// The kernels' diagnostic timeline ([num_ctas][2 ops][kTracePoints] global-timer ns) after synchronising the
  /// device; empty unless the buffer was created with kernel_trace.
  absl::StatusOr<std::vector<uint64_t>> KernelTrace();

  /// Metrics (options.metrics). The counter block's layout; num_words() == 0 when metrics are off.
  protocol::MetricsLayout metrics_layout() const { return metrics_layout_; }
  /// Copies the counter block on a private stream and waits for that copy only: never synchronises the caller's
  /// streams, so a collector thread may call it at any time. Operations are binned by a later receive launch, so
  /// the newest one's latencies may be missing until FlushMetrics().
  absl::StatusOr<std::vector<uint64_t>> MetricsSnapshot();
  /// Queues the binning of every received operation's latencies on `stream` (the stream of the operations).
  absl::Status FlushMetrics(cudaStream_t stream);

  /// Collective: synchronises the device, barrier (none when a rank is masked: it may be gone), unmaps peers and
  /// frees the region.
  absl::Status Close();

  /// Rank masking (options.shrink; DeepEP's low_latency_{update,query,clean}_mask_buffer), stream-ordered like the
  /// calls. QueryMasks copies the int32 [R] mask (1 = masked) to device memory at `dst`.
  absl::Status SetMasked(int rank, bool masked, cudaStream_t stream);
  absl::Status QueryMasks(int32_t* dst, cudaStream_t stream);
  absl::Status ClearMasks(cudaStream_t stream);
  /// Collective over the unmasked ranks (clean_low_latency_buffer), never inside a graph capture. Shrink: a barrier
  /// through the buffer (an empty dispatch launch on `stream`, metrics off), so a rank silent for the timeout is
  /// masked. Otherwise it recovers the buffer after a fatal error (a timeout, an overrun, a refused launch) when every
  /// rank calls it: synchronises the device, agrees through the bootstrap on the newest launch any rank made, resets
  /// the call state, the completion counters and the error record, and all ranks continue after that launch
  /// (older signals are then stale by sequence number). A failed proxy cannot be recovered: rebuild the buffer.
  absl::Status Clean(cudaStream_t stream);

  const protocol::LlLayout& layout() const { return layout_; }
  /// How this rank reaches each rank (index = rank).
  const std::vector<PeerPath>& peer_paths() const { return paths_; }
  /// The proxy's transport ("libfabric/shm", ...), empty when no peer uses the proxy.
  const std::string& transport_name() const { return transport_name_; }
  /// Commands, writes, bytes and immediates the proxy handled (zeros without a proxy).
  proxy::ProxyStats proxy_stats() const;
  int rank() const { return rank_; }
  int device() const { return device_; }
  int num_ctas() const { return num_ctas_; }

 private:
  GpuBuffer(const protocol::LlLayout& layout, Bootstrap& bootstrap, const GpuBufferOptions& options);
  absl::Status Init();
  absl::Status InitLocal();                          // device, limits, allocations
  absl::Status Exchange(const absl::Status& local);  // IPC handles (collective), peer mapping
  absl::Status FillDeviceContext();                  // ctx_ from the mapped peers and the buffers
  /// Collective (every rank, when any pair uses the proxy): host-staged region, rings, transports, proxy threads.
  /// `before` is this rank's setup status so far: a failure on any rank becomes an error on all of them.
  absl::Status SetUpProxy(const absl::Status& before, bool peers_share_host);
  /// This rank's end of the proxy path: the pinned host region, one FIFO ring and one transport per proxy thread
  /// (each transport's connection blob appended to `blobs`).
  absl::Status OpenProxyEnds(const std::string& transport, int threads, const std::string& fabric_node,
                             std::vector<std::unique_ptr<proxy::Transport>>* transports,
                             std::vector<std::string>* blobs);
  /// Connected transports → running proxy threads, and the device's per-peer ring table.
  absl::Status StartProxy(std::vector<std::unique_ptr<proxy::Transport>> transports, int spin);
  /// The kernels' error records as a Status: a fatal error always (sticky); a recoverable one only when
  /// raise_recoverable (CheckErrors), else logged once and kept for CheckErrors (file comment).
  absl::Status CheckErrorsLocked(cudaStream_t stream, bool raise_recoverable) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Clears the device's error claim after a recoverable error, on `stream` unless it is being captured.
  absl::Status RearmErrorRecord(cudaStream_t stream) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  /// Queues an operation's send phase (or both phases) under the next sequence number.
  absl::StatusOr<GpuPendingOp> Send(GpuPendingOp op, bool split, cudaStream_t stream);
  absl::Status Launch(const GpuPendingOp& op, kernels::cuda::LlPhase phase, cudaStream_t stream);
  void Release();

  protocol::LlLayout layout_;
  Bootstrap& bootstrap_;
  GpuBufferOptions options_;
  int rank_;
  int device_ = -1;
  int num_ctas_ = 0;
  kernels::cuda::LlLaunchHandles launch_handles_;     // the driver's launch of the kernels, or none (the runtime's)
  uint8_t* region_ = nullptr;                         // own region (device memory)
  std::vector<uint8_t*> peer_bases_;                  // [R]; peer_bases_[rank_] == region_
  uint8_t** d_peers_ = nullptr;                       // device copy of peer_bases_
  std::vector<PeerPath> paths_;                       // [R] how each rank is reached
  uint8_t* h_proxy_region_ = nullptr;                 // host-staged region (pinned, mapped), proxy paths only
  uint8_t* d_proxy_region_ = nullptr;                 // its device alias
  std::vector<std::unique_ptr<CudaFifoRing>> rings_;  // one per proxy thread
  protocol::FifoRingHandle* d_fifos_ = nullptr;       // device [R]: ring serving each proxy peer
  proxy::ProxyPtr proxy_;
  std::string transport_name_;
  absl::StatusOr<base::Options> env_;                 // LLEP_* options, read once by Exchange
  uint64_t* d_workspace_ = nullptr;                   // completion counters + flags (ll_kernels.h LlDeviceContext)
  protocol::DeviceErrorRecords* h_errors_ = nullptr;  // mapped, pinned host memory
  protocol::DeviceErrorRecords* d_errors_ = nullptr;  // its device alias
  uint64_t* d_trace_ = nullptr;                       // kernel timeline when options_.kernel_trace
  uint64_t* d_metrics_ = nullptr;                     // counter block when options_.metrics
  uint8_t* d_shrink_ = nullptr;       // options_.shrink: mask [R], verdicts, the clean barrier's outputs (ShrinkArea)
  int32_t* h_mask_values_ = nullptr;  // pinned {0, 1}: the source of SetMasked's stream-ordered copy
  kernels::cuda::OpStamps* d_stamps_ = nullptr;  // latency stamps when options_.metrics
  protocol::MetricsLayout metrics_layout_;
  absl::Mutex metrics_mu_;  // serialises snapshots (their stream and staging)
  cudaStream_t metrics_stream_ ABSL_GUARDED_BY(metrics_mu_) = nullptr;  // non-blocking: copies overlap the kernels
  uint64_t* h_metrics_ ABSL_GUARDED_BY(metrics_mu_) = nullptr;          // pinned staging of the snapshot
  kernels::cuda::LlDeviceContext ctx_;                                  // what every launch passes (fixed after Init)
  mutable absl::Mutex mu_;
  CallSequence calls_ ABSL_GUARDED_BY(mu_);     // sequence numbers and the in-flight rule
  absl::Status fatal_ ABSL_GUARDED_BY(mu_);     // sticky error after a timeout / overrun
  uint32_t last_tag_ ABSL_GUARDED_BY(mu_) = 0;  // the last send's call tag (unique per send, never 0)
  bool rearm_ ABSL_GUARDED_BY(mu_) = false;     // a recoverable error was reported; the device claim is not cleared yet
  bool warned_ ABSL_GUARDED_BY(mu_) = false;    // the recoverable record was logged by a call, not raised yet
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace llep
