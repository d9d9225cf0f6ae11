// GpuBuffer's calls (runtime/gpu_buffer.h): dispatch, combine, receive, the kernels' error record, metrics, close.
// Creation and peer mapping live in gpu_buffer_setup.cc.
#include "runtime/gpu_buffer.h"

#include "absl/strings/str_cat.h"
#include "runtime/base/status_macros.h"
#include "runtime/device_error_status.h"
#include "runtime/gpu_buffer_internal.h"
#include "runtime/validate.h"

namespace llep {

using gpu_buffer_internal::CudaStatus;
using gpu_buffer_internal::TraceBytes;
using protocol::LlOp;

namespace {}  // namespace

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
  if (proxy_ != nullptr && proxy_->failed()) {
    // The proxy's own error explains whatever the kernels saw after it (pushes refused, peers timing out).
    const absl::Status ps = proxy_->status();
    fatal_ = absl::Status(ps.code(), absl::StrCat("the proxy (", transport_name_, ") failed: ", ps.message()));
    return fatal_;
  }
  volatile protocol::DeviceErrorRecord* e = h_error_;
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
  LLEP_RETURN_IF_ERROR(ValidateDispatchCall(layout_.shape, call, options_.metrics_layers));
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
