// GpuBuffer's calls (runtime/gpu_buffer.h): dispatch, combine, receive, the kernels' error record, metrics, close.
// Creation and peer mapping live in gpu_buffer_setup.cc.
#include "runtime/gpu_buffer.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "runtime/base/log.h"
#include "runtime/base/status_macros.h"
#include "runtime/device_error_status.h"
#include "runtime/gpu_buffer_internal.h"
#include "runtime/validate.h"

namespace llep {

using gpu_buffer_internal::CudaStatus;
using gpu_buffer_internal::TraceBytes;
using protocol::LlOp;

namespace {}  // namespace

absl::Status GpuBuffer::CheckErrors(bool bad_input) {
  absl::MutexLock lock(&mu_);
  return CheckErrorsLocked(nullptr, bad_input);
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

absl::Status GpuBuffer::CheckErrorsLocked(cudaStream_t stream, bool raise_recoverable) {
  if (closed_) return absl::FailedPreconditionError("buffer is closed");
  if (!fatal_.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the buffer is unusable after an earlier error (rebuild it): ", fatal_.message()));
  }
  if (proxy_ != nullptr && proxy_->failed()) {
    // The proxy's own error explains whatever the kernels saw after it (pushes refused, peers timing out).
    const absl::Status ps = proxy_->status();
    fatal_ = absl::Status(ps.code(), absl::StrCat("the proxy (", transport_name_, ") failed: ", ps.message()));
    return fatal_;
  }
  // The fatal record first: it may follow a recoverable error the host has not read yet (DeviceErrorRecords).
  volatile protocol::DeviceErrorRecord* e = &h_errors_->fatal;
  if (e->code == protocol::kDeviceOk) e = &h_errors_->recoverable;
  const uint32_t code = e->code;
  if (code == protocol::kDeviceOk) {
    const absl::Status rearm = RearmErrorRecord(stream);
    if (!rearm.ok()) fatal_ = rearm;
    return rearm;
  }
  __atomic_thread_fence(__ATOMIC_ACQUIRE);  // the kernel stored the fields before the code
  const protocol::DeviceErrorRecord record{code, e->op, e->peer, e->seq, e->detail};
  const absl::Status s = DeviceErrorToStatus(record, {rank_, layout_.shape.num_experts, options_.timeout,
                                                      proxy_ != nullptr ? proxy_->status().ToString() : ""});
  if (protocol::DeviceErrorIsRecoverable(code)) {
    if (!raise_recoverable) {
      // A call does not raise it (gpu_buffer.h: whether the kernel finished before this call depends on timing, so
      // ranks given the same input would make different call sequences); it says so once and keeps the record.
      if (!warned_) {
        LLEP_LOG(kWarning) << s.message() << " (raised by Buffer.check_errors())";
        warned_ = true;
      }
      return absl::OkStatus();
    }
    // Recoverable: the kernels kept the buffer consistent. Re-arm the record behind the work already queued, but not
    // into a graph being captured (every replay would re-arm it): then the next call outside a capture does it.
    warned_ = false;
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
  LLEP_RETURN_IF_ERROR(ValidateDispatchCall(layout_.shape, call, options_.metrics_layers));
  if (call.carries_weights && call.num_tokens > kernels::cuda::kMaxCarriedPlanTokensPerCta * num_ctas_) {
    // The home rank keeps the weights with the dispatch's plan (CarriedPlanArea), which holds one round per CTA.
    return absl::InvalidArgumentError(
        absl::StrCat("combine_weights at dispatch takes at most ",
                     kernels::cuda::kMaxCarriedPlanTokensPerCta * num_ctas_, " tokens with this buffer's ", num_ctas_,
                     " CTAs (got ", call.num_tokens, "): dispatch without them, or build the buffer with more CTAs"));
  }
  GpuPendingOp op;
  op.op = LlOp::kDispatch;
  static_cast<DispatchCall&>(op.dispatch) = call;
  op.dispatch.ctx = ctx_;
  return Send(std::move(op), split, stream);
}

absl::StatusOr<GpuPendingOp> GpuBuffer::Combine(const CombineCall& call, bool split, cudaStream_t stream) {
  LLEP_RETURN_IF_ERROR(ValidateCombineCall(layout_.shape, call));
  GpuPendingOp op;
  op.op = LlOp::kCombine;
  static_cast<CombineCall&>(op.combine) = call;
  op.combine.ctx = ctx_;
  return Send(std::move(op), split, stream);
}

absl::StatusOr<GpuPendingOp> GpuBuffer::Send(GpuPendingOp op, bool split, cudaStream_t stream) {
  absl::MutexLock lock(&mu_);
  LLEP_RETURN_IF_ERROR(CheckErrorsLocked(stream, /*raise_recoverable=*/false));
  LLEP_ASSIGN_OR_RETURN(op.seq, calls_.Begin(op.op));
  // The host's sequence only checks the in-flight rule in issue order; the kernels number operations themselves and
  // pair a receive launch with its send by this tag (ll_kernels.h LlCallState), so graph replays stay consistent.
  if (++last_tag_ == 0) last_tag_ = 1;
  op.dispatch.call_tag = op.combine.call_tag = last_tag_;
  // The receive phase's grid, decided once here: a hook's receive launch runs its own, usually smaller one
  // (ReceiveOnlyCtas), the fused launch the buffer's; a combine's split is made for it.
  const bool combine = op.op == LlOp::kCombine;
  op.recv_ctas = !split ? num_ctas_
                        : kernels::cuda::ReceiveOnlyCtas(
                              num_ctas_, layout_.shape.num_ranks, combine ? op.combine.num_topk : op.dispatch.num_topk,
                              combine ? op.combine.num_tokens : op.dispatch.num_tokens, layout_.shape.hidden, combine,
                              !combine && op.dispatch.mode.use_fp8);
  if (combine) {
    op.combine.split = kernels::cuda::PlanCombineRecvSplit(layout_.shape.hidden, op.combine.num_tokens, op.recv_ctas);
  }
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
  LLEP_RETURN_IF_ERROR(CheckErrorsLocked(stream, /*raise_recoverable=*/false));
  return Launch(op, kernels::cuda::kPhaseRecv, stream);
}

absl::Status GpuBuffer::Launch(const GpuPendingOp& op, kernels::cuda::LlPhase phase, cudaStream_t stream) {
  LLEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));  // hooks may run on another thread (vLLM)
  const kernels::cuda::LaunchConfig cfg{phase == kernels::cuda::kPhaseRecv ? op.recv_ctas : num_ctas_,
                                        &launch_handles_};
  if (op.op == LlOp::kDispatch) {
    LLEP_CUDA_RETURN_IF_ERROR(kernels::cuda::LaunchDispatch(op.dispatch, phase, cfg, stream));
  } else {
    LLEP_CUDA_RETURN_IF_ERROR(kernels::cuda::LaunchCombine(op.combine, phase, cfg, stream));
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
  (void)cudaThreadExchangeStreamCaptureMode(&mode);  // restores the caller's mode
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

absl::Status GpuBuffer::SetMasked(int rank, bool masked, cudaStream_t stream) {
  if (d_shrink_ == nullptr)
    return absl::FailedPreconditionError("rank masking needs a buffer created with enable_shrink");
  if (rank < 0 || rank >= layout_.shape.num_ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank_to_mask ", rank, " is outside [0, ", layout_.shape.num_ranks, ")"));
  }
  LLEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  LLEP_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ctx_.mask + rank, h_mask_values_ + (masked ? 1 : 0), sizeof(int32_t),
                                            cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

absl::Status GpuBuffer::QueryMasks(int32_t* dst, cudaStream_t stream) {
  if (d_shrink_ == nullptr)
    return absl::FailedPreconditionError("rank masking needs a buffer created with enable_shrink");
  LLEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  LLEP_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(dst, ctx_.mask, sizeof(int32_t) * layout_.shape.num_ranks, cudaMemcpyDeviceToDevice, stream));
  return absl::OkStatus();
}

absl::Status GpuBuffer::ClearMasks(cudaStream_t stream) {
  if (d_shrink_ == nullptr)
    return absl::FailedPreconditionError("rank masking needs a buffer created with enable_shrink");
  LLEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  LLEP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(ctx_.mask, 0, sizeof(int32_t) * layout_.shape.num_ranks, stream));
  return absl::OkStatus();
}

absl::Status GpuBuffer::Clean(cudaStream_t stream) {
  const int R = layout_.shape.num_ranks;
  LLEP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  if (d_shrink_ != nullptr) {
    // A dispatch of no tokens is a barrier among the unmasked ranks; its receive masks a rank silent for the timeout.
    const gpu_buffer_internal::ShrinkArea area{R, layout_.shape.num_local_experts()};
    GpuPendingOp op;
    op.op = LlOp::kDispatch;
    op.dispatch.num_topk = 1;
    op.dispatch.mode.use_fp8 = false;
    op.dispatch.recv_x = d_shrink_ + area.recv_x();
    op.dispatch.recv_count = reinterpret_cast<int32_t*>(d_shrink_ + area.recv_count());
    op.dispatch.src_info = reinterpret_cast<int32_t*>(d_shrink_ + area.src_info());
    op.dispatch.layout_range = reinterpret_cast<int64_t*>(d_shrink_ + area.layout_range());
    op.dispatch.ctx = ctx_;
    op.dispatch.ctx.metrics = nullptr;  // not an operation of the user's
    {
      absl::MutexLock lock(&mu_);
      calls_.Restart(calls_.last());  // operations a failed call left unreceived are abandoned
    }
    return Send(std::move(op), /*split=*/false, stream).status();
  }
  // Recovery after a fatal error: every launch is finished once the device is idle (waits end at the timeout).
  LLEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  absl::MutexLock lock(&mu_);
  if (closed_) return absl::FailedPreconditionError("buffer is closed");
  if (proxy_ != nullptr && proxy_->failed()) {
    return absl::FailedPreconditionError(
        absl::StrCat("the proxy (", transport_name_, ") failed; rebuild the buffer: ", proxy_->status().message()));
  }
  std::vector<kernels::cuda::LlCtaLaunches> counts(static_cast<size_t>(num_ctas_));
  LLEP_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(counts.data(), ctx_.launches, sizeof(counts[0]) * counts.size(), cudaMemcpyDeviceToHost));
  uint64_t launches = 0;  // a refused launch still took its number; every CTA counted it (the most, to be safe)
  for (const auto& cta : counts) launches = std::max<uint64_t>(launches, cta.sends);
  LLEP_ASSIGN_OR_RETURN(const std::vector<uint64_t> all, bootstrap_.AllGatherU64(launches));
  const uint64_t newest = *std::max_element(all.begin(), all.end());
  // Every rank's next send takes launch index `newest` + 1 (one spare: a number no rank used), so every signal word
  // written before is older than any call after; nothing is in flight and no region is held.
  const auto ws = gpu_buffer_internal::Workspace::Of(layout_.shape, num_ctas_);
  LLEP_CUDA_RETURN_IF_ERROR(cudaMemset(d_workspace_, 0, ws.bytes()));
  for (auto& cta : counts) cta = kernels::cuda::LlCtaLaunches{newest + 1, 0};
  LLEP_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(ctx_.launches, counts.data(), sizeof(counts[0]) * counts.size(), cudaMemcpyHostToDevice));
  std::memset(h_errors_, 0, sizeof(protocol::DeviceErrorRecords));
  LLEP_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  fatal_ = absl::OkStatus();
  rearm_ = false;
  warned_ = false;
  calls_.Restart(calls_.last());
  // Nobody sends the next call before every rank reset (a signal into a reset workspace would be lost).
  return bootstrap_.Barrier();
}

absl::Status GpuBuffer::Close() {
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::OkStatus();
    closed_ = true;
  }
  (void)cudaSetDevice(device_);
  absl::Status s = CudaStatus(cudaDeviceSynchronize(), "synchronising before close");
  // No peer may still write into a region that is about to be freed. A masked rank may be gone: no barrier then.
  bool any_masked = false;
  if (d_shrink_ != nullptr) {
    std::vector<int32_t> masks(layout_.shape.num_ranks);
    if (cudaMemcpy(masks.data(), ctx_.mask, masks.size() * sizeof(int32_t), cudaMemcpyDeviceToHost) == cudaSuccess) {
      any_masked = std::find(masks.begin(), masks.end(), 1) != masks.end();
    }
  }
  const absl::Status b = any_masked ? absl::OkStatus() : bootstrap_.Barrier();
  if (s.ok()) s = b;
  Release();
  return s;
}

}  // namespace llep
