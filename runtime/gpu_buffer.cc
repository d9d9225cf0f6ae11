#include "runtime/gpu_buffer.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "runtime/base/status_macros.h"
#include "runtime/protocol/signal.h"
#include "runtime/validate.h"

namespace llep {

using kernels::cuda::GpuErrorInfo;
using protocol::LlOp;

namespace {

const char* OpName(LlOp op) { return op == LlOp::kDispatch ? "dispatch" : "combine"; }

absl::Status CudaStatus(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}
#define LLEP_CUDA_RETURN_IF_ERROR(expr) LLEP_RETURN_IF_ERROR(CudaStatus((expr), #expr))

// What every rank publishes so its peers can map its region.
struct RegionBlob {
  uint32_t magic;
  uint32_t layout_version;
  int64_t total_bytes;
  int32_t device;
  int32_t pid;
  char host[64];
  cudaIpcMemHandle_t handle;
  uint32_t ok;  // 0: this rank could not set its region up; error says why
  char error[256];
};
constexpr uint32_t kRegionBlobMagic = 0x4C4C4550;  // "LLEP"

// The device workspace: [2 halves][2 ops][R] 64-bit completion counters, one 64-bit word holding the two 32-bit
// flags, then, 128-byte aligned (the kernels load its records in 16-byte words), the call state (ll_kernels.h
// LlDeviceContext, LlCallState). All of it starts zeroed.
int64_t WorkspaceCounters(int R) { return int64_t{protocol::kNumHalves} * protocol::kNumLlOps * R; }
int64_t CallStateOffset(int R) { return protocol::AlignUp((WorkspaceCounters(R) + 1) * 8, 128); }
size_t WorkspaceBytes(int R) { return static_cast<size_t>(CallStateOffset(R)) + sizeof(kernels::cuda::LlCallState); }

size_t TraceBytes(int num_ctas) {
  return sizeof(uint64_t) * protocol::kNumLlOps * num_ctas * kernels::cuda::kTracePoints;
}

}  // namespace

GpuBuffer::GpuBuffer(const protocol::LlLayout& layout, Bootstrap& bootstrap, const GpuBufferOptions& options)
    : layout_(layout), bootstrap_(bootstrap), options_(options), rank_(bootstrap.rank()) {}

GpuBuffer::~GpuBuffer() { Release(); }

absl::StatusOr<std::unique_ptr<GpuBuffer>> GpuBuffer::Create(const protocol::LlShape& shape, Bootstrap& bootstrap,
                                                             const GpuBufferOptions& options) {
  LLEP_RETURN_IF_ERROR(ValidateShape(shape));
  if (bootstrap.size() != shape.num_ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("bootstrap has ", bootstrap.size(), " ranks but the shape says ", shape.num_ranks));
  }
  if (options.timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("timeout must be positive");
  if (options.num_ctas < 0) return absl::InvalidArgumentError("num_ctas must be >= 0 (0 = one per SM)");
  std::unique_ptr<GpuBuffer> b(new GpuBuffer(protocol::ComputeLlLayout(shape), bootstrap, options));
  LLEP_RETURN_IF_ERROR(b->Init());
  return b;
}

absl::Status GpuBuffer::Init() {
  // Every rank takes part in the exchange even when its own setup failed, so a failure on one rank (e.g. out of
  // device memory) becomes an error naming it on every rank instead of peers waiting in a collective.
  const absl::Status local = InitLocal();
  return Exchange(local);
}

absl::Status GpuBuffer::InitLocal() {
  const protocol::LlShape& shape = layout_.shape;
  const int R = shape.num_ranks;
  if (options_.device >= 0) {
    LLEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  }
  LLEP_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device_));
  int sms = 0, smem_optin = 0;
  LLEP_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
  LLEP_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_));
  // Every CTA of a launch must be resident (ll_kernels.h): never more CTAs than SMs.
  num_ctas_ = options_.num_ctas == 0 ? sms : std::min(options_.num_ctas, sms);
  // ...and enough CTAs that none counts the routes of more than kMaxDestinationsPerCta ranks.
  const int min_ctas = (R + kernels::cuda::kMaxDestinationsPerCta - 1) / kernels::cuda::kMaxDestinationsPerCta;
  if (min_ctas > sms) {
    return absl::InvalidArgumentError(
        absl::StrCat(R, " ranks need ", min_ctas, " CTAs per launch; device ", device_, " has ", sms, " SMs"));
  }
  num_ctas_ = std::max(num_ctas_, min_ctas);
  const int64_t smem = std::max(kernels::cuda::DispatchSharedBytes(shape), kernels::cuda::CombineSharedBytes(shape));
  if (smem > smem_optin) {
    return absl::InvalidArgumentError(absl::StrCat("num_experts=", shape.num_experts, " with num_ranks=", R, " needs ",
                                                   smem, " bytes of shared memory per CTA; device ", device_,
                                                   " allows ", smem_optin));
  }
  LLEP_CUDA_RETURN_IF_ERROR(kernels::cuda::ConfigureLlKernels(smem));

  void* p = nullptr;
  LLEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, static_cast<size_t>(layout_.total_bytes)));
  region_ = static_cast<uint8_t*>(p);
  // Zeroed signal words read "never signalled" (signal.h), so the region needs no per-call cleaning.
  LLEP_CUDA_RETURN_IF_ERROR(cudaMemset(region_, 0, static_cast<size_t>(layout_.total_bytes)));
  LLEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, WorkspaceBytes(R)));
  d_workspace_ = static_cast<uint64_t*>(p);
  LLEP_CUDA_RETURN_IF_ERROR(cudaMemset(d_workspace_, 0, WorkspaceBytes(R)));
  LLEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, sizeof(GpuErrorInfo), cudaHostAllocMapped));
  h_error_ = static_cast<GpuErrorInfo*>(p);
  std::memset(h_error_, 0, sizeof(GpuErrorInfo));
  LLEP_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&p, h_error_, 0));
  d_error_ = static_cast<GpuErrorInfo*>(p);
  if (options_.metrics) {
    metrics_layout_ = protocol::ComputeMetricsLayout(R, shape.num_local_experts());
    const size_t bytes = static_cast<size_t>(metrics_layout_.num_bytes());
    LLEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes));
    d_metrics_ = static_cast<uint64_t*>(p);
    LLEP_CUDA_RETURN_IF_ERROR(cudaMemset(d_metrics_, 0, bytes));
    LLEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, sizeof(kernels::cuda::OpStamps) * kernels::cuda::kStampSlots));
    d_stamps_ = static_cast<kernels::cuda::OpStamps*>(p);
    LLEP_CUDA_RETURN_IF_ERROR(cudaMemset(d_stamps_, 0, sizeof(kernels::cuda::OpStamps) * kernels::cuda::kStampSlots));
    absl::MutexLock lock(&metrics_mu_);
    LLEP_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&metrics_stream_, cudaStreamNonBlocking));
    LLEP_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&p, bytes, cudaHostAllocDefault));
    h_metrics_ = static_cast<uint64_t*>(p);
  }
  if (options_.kernel_trace) {
    LLEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, TraceBytes(num_ctas_)));
    d_trace_ = static_cast<uint64_t*>(p);
    LLEP_CUDA_RETURN_IF_ERROR(cudaMemset(d_trace_, 0, TraceBytes(num_ctas_)));
  }
  LLEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return absl::OkStatus();
}

absl::Status GpuBuffer::Exchange(const absl::Status& local) {
  const int R = layout_.shape.num_ranks;
  void* p = nullptr;
  RegionBlob mine{};
  mine.ok = local.ok() ? 1 : 0;
  std::strncpy(mine.error, std::string(local.message()).c_str(), sizeof(mine.error) - 1);
  mine.magic = kRegionBlobMagic;
  mine.layout_version = protocol::kLlLayoutVersion;
  mine.total_bytes = layout_.total_bytes;
  mine.device = device_;
  mine.pid = static_cast<int32_t>(getpid());
  gethostname(mine.host, sizeof(mine.host) - 1);
  absl::Status own = local;
  if (own.ok()) {
    own = CudaStatus(cudaIpcGetMemHandle(&mine.handle, region_), "cudaIpcGetMemHandle");
    mine.ok = own.ok() ? 1 : 0;
    std::strncpy(mine.error, std::string(own.message()).c_str(), sizeof(mine.error) - 1);
  }
  LLEP_ASSIGN_OR_RETURN(std::vector<std::string> all,
                        bootstrap_.AllGather(std::string(reinterpret_cast<const char*>(&mine), sizeof(mine))));
  if (!own.ok()) return own;
  for (int r = 0; r < R; ++r) {
    RegionBlob peer{};
    if (all[r].size() == sizeof(RegionBlob)) std::memcpy(&peer, all[r].data(), sizeof(peer));
    if (peer.magic == kRegionBlobMagic && !peer.ok) {
      return absl::FailedPreconditionError(absl::StrCat("rank ", r, " could not create its GPU buffer: ", peer.error));
    }
  }
  peer_bases_.assign(R, nullptr);
  peer_bases_[rank_] = region_;
  for (int r = 0; r < R; ++r) {
    if (all[r].size() != sizeof(RegionBlob)) return absl::DataLossError(absl::StrCat("rank ", r, ": bad region blob"));
    RegionBlob peer;
    std::memcpy(&peer, all[r].data(), sizeof(peer));
    if (peer.magic != kRegionBlobMagic || peer.layout_version != protocol::kLlLayoutVersion ||
        peer.total_bytes != layout_.total_bytes) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", r, " built a different buffer (", peer.total_bytes, " bytes, layout v", peer.layout_version,
          ") than this rank (", layout_.total_bytes, " bytes, v", protocol::kLlLayoutVersion,
          "): every rank must use the same num_max_dispatch_tokens_per_rank, hidden and num_experts"));
    }
    if (std::strncmp(peer.host, mine.host, sizeof(mine.host)) != 0) {
      return absl::UnimplementedError(absl::StrCat("rank ", r, " runs on host '", peer.host, "', this rank on '",
                                                   mine.host, "': the GPU backend maps same-host peers only"));
    }
    if (r == rank_) continue;
    void* mapped = nullptr;
    LLEP_RETURN_IF_ERROR(
        CudaStatus(cudaIpcOpenMemHandle(&mapped, peer.handle, cudaIpcMemLazyEnablePeerAccess),
                   absl::StrCat("mapping rank ", r, "'s region (device ", peer.device, ") with CUDA IPC")));
    peer_bases_[r] = static_cast<uint8_t*>(mapped);
  }
  LLEP_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, sizeof(uint8_t*) * R));
  d_peers_ = static_cast<uint8_t**>(p);
  LLEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(d_peers_, peer_bases_.data(), sizeof(uint8_t*) * R, cudaMemcpyHostToDevice));
  ctx_.layout = layout_;
  ctx_.rank = rank_;
  ctx_.peers = d_peers_;
  ctx_.local = region_;
  ctx_.done = d_workspace_;
  ctx_.flags = reinterpret_cast<uint32_t*>(d_workspace_ + WorkspaceCounters(R));
  ctx_.calls =
      reinterpret_cast<kernels::cuda::LlCallState*>(reinterpret_cast<uint8_t*>(d_workspace_) + CallStateOffset(R));
  ctx_.error = d_error_;
  ctx_.timeout_ns = static_cast<uint64_t>(absl::ToInt64Nanoseconds(options_.timeout));
  ctx_.trace = d_trace_;
  ctx_.metrics = d_metrics_;
  ctx_.stamps = d_stamps_;
  ctx_.metrics_layout = metrics_layout_;
  // Nobody writes into a peer before every rank mapped every region.
  return bootstrap_.Barrier();
}

void GpuBuffer::Release() {
  if (device_ >= 0) cudaSetDevice(device_);
  for (int r = 0; r < static_cast<int>(peer_bases_.size()); ++r) {
    if (r != rank_ && peer_bases_[r] != nullptr) cudaIpcCloseMemHandle(peer_bases_[r]);
  }
  peer_bases_.clear();
  if (d_peers_ != nullptr) cudaFree(d_peers_);
  if (d_workspace_ != nullptr) cudaFree(d_workspace_);
  if (region_ != nullptr) cudaFree(region_);
  if (h_error_ != nullptr) cudaFreeHost(h_error_);
  if (d_trace_ != nullptr) cudaFree(d_trace_);
  if (d_stamps_ != nullptr) cudaFree(d_stamps_);
  {
    absl::MutexLock lock(&metrics_mu_);  // a snapshot in progress finishes first
    if (d_metrics_ != nullptr) cudaFree(d_metrics_);
    if (metrics_stream_ != nullptr) cudaStreamDestroy(metrics_stream_);
    if (h_metrics_ != nullptr) cudaFreeHost(h_metrics_);
    metrics_stream_ = nullptr;
    h_metrics_ = nullptr;
  }
  d_trace_ = nullptr;
  d_metrics_ = nullptr;
  d_stamps_ = nullptr;
  d_peers_ = nullptr;
  d_workspace_ = nullptr;
  region_ = nullptr;
  h_error_ = nullptr;
  d_error_ = nullptr;
}

absl::Status GpuBuffer::CheckErrors() {
  absl::MutexLock lock(&mu_);
  return CheckErrorsLocked(nullptr);
}

absl::Status GpuBuffer::RearmErrorRecord(cudaStream_t stream) {
  if (!rearm_) return absl::OkStatus();
  LLEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (stream != nullptr) LLEP_CUDA_RETURN_IF_ERROR(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return absl::OkStatus();
  LLEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(ctx_.flags, 0, 4, stream));
  rearm_ = false;
  return absl::OkStatus();
}

absl::Status GpuBuffer::CheckErrorsLocked(cudaStream_t stream) {
  if (closed_) return absl::FailedPreconditionError("buffer is closed");
  if (!fatal_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the buffer is unusable after an earlier error (rebuild it): ", fatal_.message()));
  }
  volatile GpuErrorInfo* e = h_error_;
  const uint32_t code = e->code;
  if (code == kernels::cuda::kGpuOk) {
    const absl::Status rearm = RearmErrorRecord(stream);
    if (!rearm.ok()) fatal_ = rearm;
    return rearm;
  }
  __atomic_thread_fence(__ATOMIC_ACQUIRE);  // the kernel stored the fields before the code
  const LlOp op = e->op == 0 ? LlOp::kDispatch : LlOp::kCombine;
  const int peer = e->peer;
  const uint32_t seq = e->seq;
  const int64_t detail = e->detail;
  const std::string where = absl::StrCat("GPU ", OpName(op), " call ", seq, ": ");
  absl::Status s;
  switch (code) {
    case kernels::cuda::kGpuBadExpertId:
      s = absl::InvalidArgumentError(
          absl::StrCat(where, "topk_idx holds expert id ", detail, ", outside [-1, ", layout_.shape.num_experts,
                       ") or repeated within one token; that selection was dropped (treated as -1)"));
      break;
    case kernels::cuda::kGpuBadLayoutRange:
      s = absl::InvalidArgumentError(absl::StrCat(where, "the handle's layout_range is inconsistent (entry or total ",
                                                  detail, ", home rank ", peer,
                                                  "); those rows were not sent: pass the handle of the matching "
                                                  "dispatch"));
      break;
    case kernels::cuda::kGpuTimeout:
      s = absl::DeadlineExceededError(
          absl::StrCat(where,
                       peer == rank_ ? "this rank's own kernel did not finish its sends"
                                     : absl::StrCat("rank ", peer, " did not signal"),
                       " within ", absl::FormatDuration(options_.timeout),
                       " (peer dead, stalled, or calling a different sequence of operations)"));
      break;
    case kernels::cuda::kGpuInFlight:
      s = absl::FailedPreconditionError(absl::StrCat(
          where, "its buffer half still held call ", detail,
          ", whose receive (hook) had not run (nothing was sent): at most two low-latency operations may be in "
          "flight per buffer (a captured graph that sends without receiving was replayed again before its receive "
          "ran)"));
      break;
    case kernels::cuda::kGpuBadReceive:
      s = absl::FailedPreconditionError(absl::StrCat(
          "GPU ", OpName(op), " receive (hook, call tag ", detail,
          "): its operation was not waiting for it (already received, or its send never ran): a graph holding "
          "the receive was replayed without a new replay of the send"));
      break;
    case kernels::cuda::kGpuRegionBusy:
      s = absl::FailedPreconditionError(absl::StrCat(
          where, "it would overwrite, on its peers, the receive region of the previous ", OpName(op),
          " in its buffer half before they are known to have received it (nothing was sent): between that "
          "receive and this send, this rank must send and receive another operation, e.g. alternate dispatch and "
          "combine (replayed graphs broke the rule; runtime/call_sequence.h)"));
      break;
    case kernels::cuda::kGpuSequenceOverrun:
      s = absl::DataLossError(absl::StrCat(where, "rank ", peer, " already signalled call ", detail,
                                           " into the same half: more operations were in flight than allowed"));
      break;
    default:
      s = absl::DataLossError(absl::StrCat(where, "inconsistent data from rank ", peer, " (error code ", code,
                                           ", detail ", detail,
                                           "): ranks disagree on the call sequence, topk_idx "
                                           "of dispatch and combine, or the buffer shape"));
      break;
  }
  if (code == kernels::cuda::kGpuBadExpertId || code == kernels::cuda::kGpuBadLayoutRange) {
    // Recoverable: the kernels kept the buffer consistent. Re-arm the record behind the work already queued, but not
    // into a graph being captured (every replay would re-arm it): then the next call outside a capture does it.
    e->code = 0;
    rearm_ = true;
    const absl::Status clear = RearmErrorRecord(stream);
    if (!clear.ok()) fatal_ = clear;
    return s;
  }
  fatal_ = s;
  return s;
}

absl::StatusOr<GpuPendingOp> GpuBuffer::Dispatch(const DispatchCall& call, bool split, cudaStream_t stream) {
  LLEP_RETURN_IF_ERROR(ValidateDispatchCall(layout_.shape, call));
  GpuPendingOp op;
  op.op = LlOp::kDispatch;
  kernels::cuda::DispatchParams& p = op.dispatch;
  p.ctx = ctx_;
  p.mode = call.mode;
  p.x = call.x;
  p.topk_idx = call.topk_idx;
  p.num_tokens = call.num_tokens;
  p.num_topk = call.num_topk;
  p.recv_x = call.recv_x;
  p.recv_scales = call.recv_scales;
  p.recv_count = call.recv_count;
  p.src_info = call.src_info;
  p.layout_range = call.layout_range;
  p.cumulative_stats = call.cumulative_local_expert_recv_stats;
  p.wait_stats = call.wait_recv_cost_stats;
  return Send(std::move(op), split, stream);
}

absl::StatusOr<GpuPendingOp> GpuBuffer::Combine(const CombineCall& call, bool split, cudaStream_t stream) {
  LLEP_RETURN_IF_ERROR(ValidateCombineCall(layout_.shape, call));
  GpuPendingOp op;
  op.op = LlOp::kCombine;
  kernels::cuda::CombineParams& p = op.combine;
  p.ctx = ctx_;
  p.x = call.zero_copy ? nullptr : call.x;
  p.layout_range = call.layout_range;
  p.topk_idx = call.topk_idx;
  p.topk_weights = call.topk_weights;
  p.num_tokens = call.num_tokens;
  p.num_topk = call.num_topk;
  p.out = call.out;
  p.wait_stats = call.wait_recv_cost_stats;
  return Send(std::move(op), split, stream);
}

absl::StatusOr<GpuPendingOp> GpuBuffer::Send(GpuPendingOp op, bool split, cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  LLEP_RETURN_IF_ERROR(CheckErrorsLocked(stream));
  LLEP_ASSIGN_OR_RETURN(op.seq, calls_.Begin(op.op));
  // The host's sequence only checks the in-flight rule in issue order; the kernels number operations themselves and
  // pair a receive launch with its send by this tag (ll_kernels.h LlCallState), so graph replays stay consistent.
  if (++last_tag_ == 0) last_tag_ = 1;
  op.dispatch.call_tag = op.combine.call_tag = last_tag_;
  LLEP_RETURN_IF_ERROR(Launch(op, split ? kernels::cuda::kPhaseSend : kernels::cuda::kPhaseBoth, stream));
  if (split) {
    calls_.AwaitReceive(op.seq);
  } else {
    calls_.Completed(op.seq);
  }
  return op;
}

absl::Status GpuBuffer::Receive(const GpuPendingOp& op, cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  if (!calls_.Received(op.seq)) {
    return absl::FailedPreconditionError("operation already received or not sent on this buffer");
  }
  LLEP_RETURN_IF_ERROR(CheckErrorsLocked(stream));
  return Launch(op, kernels::cuda::kPhaseRecv, stream);
}

absl::Status GpuBuffer::Launch(const GpuPendingOp& op, kernels::cuda::LlPhase phase, cudaStream_t stream) {
  LLEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));  // hooks may run on another thread (vLLM)
  if (op.op == LlOp::kDispatch) {
    LLEP_CUDA_RETURN_IF_ERROR(kernels::cuda::LaunchDispatch(op.dispatch, phase, {num_ctas_}, stream));
  } else {
    LLEP_CUDA_RETURN_IF_ERROR(kernels::cuda::LaunchCombine(op.combine, phase, {num_ctas_}, stream));
  }
  return absl::OkStatus();
}

uint16_t* GpuBuffer::NextCombineBuffer() const {
  return reinterpret_cast<uint16_t*>(region_ + layout_.CombineSendOffset(kernels::cuda::kZeroCopyHalf, 0, 0));
}

absl::StatusOr<std::vector<uint64_t>> GpuBuffer::KernelTrace() {
  std::vector<uint64_t> out;
  if (d_trace_ == nullptr) return out;
  LLEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  LLEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  out.resize(TraceBytes(num_ctas_) / sizeof(uint64_t));
  LLEP_CUDA_RETURN_IF_ERROR(cudaMemcpy(out.data(), d_trace_, TraceBytes(num_ctas_), cudaMemcpyDeviceToHost));
  return out;
}

absl::StatusOr<std::vector<uint64_t>> GpuBuffer::MetricsSnapshot() {
  std::vector<uint64_t> out;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::FailedPreconditionError("buffer is closed");
  }
  absl::MutexLock lock(&metrics_mu_);
  if (d_metrics_ == nullptr || h_metrics_ == nullptr) return out;
  const size_t bytes = static_cast<size_t>(metrics_layout_.num_bytes());
  LLEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));  // collector threads start on device 0
  // The collector thread may snapshot while another thread captures a graph in global mode (torch.cuda.graph's
  // default), which forbids this thread's synchronising calls and would invalidate that capture. The copy and the
  // wait touch only this private stream, so this thread opts out of the prohibition (relaxed) for their duration.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  LLEP_CUDA_RETURN_IF_ERROR(cudaThreadExchangeStreamCaptureMode(&mode));
  cudaError_t e = cudaMemcpyAsync(h_metrics_, d_metrics_, bytes, cudaMemcpyDeviceToHost, metrics_stream_);
  if (e == cudaSuccess) e = cudaStreamSynchronize(metrics_stream_);
  cudaThreadExchangeStreamCaptureMode(&mode);  // restores the caller's mode
  LLEP_RETURN_IF_ERROR(CudaStatus(e, "copying the metrics counters"));
  out.assign(h_metrics_, h_metrics_ + metrics_layout_.num_words());
  return out;
}

absl::Status GpuBuffer::FlushMetrics(cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  if (closed_) return absl::FailedPreconditionError("buffer is closed");
  LLEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  LLEP_CUDA_RETURN_IF_ERROR(kernels::cuda::FlushLlMetrics(ctx_, stream));
  return absl::OkStatus();
}

absl::Status GpuBuffer::Close() {
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::OkStatus();
    closed_ = true;
  }
  cudaSetDevice(device_);
  absl::Status s = CudaStatus(cudaDeviceSynchronize(), "synchronising before close");
  // No peer may still write into a region that is about to be freed.
  const absl::Status b = bootstrap_.Barrier();
  if (s.ok()) s = b;
  Release();
  return s;
}

}  // namespace llep
