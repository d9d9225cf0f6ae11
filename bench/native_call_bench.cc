// The host cost of GpuBuffer::Dispatch / Combine called from C++ (issue #19 item 2: host CPU per call), one rank on one
// GPU, the GPU kept busy ahead so no call waits for the device: medians of `--iters` calls, in ns. What it answers:
// how much of the Python-level native call (bench/host_path_breakdown.py's "native dispatch (addresses ready)", ~5 µs
// on an H100 host) is the runtime's own call (validation, error record, call sequence, parameter block, launch) and
// how much the crossing from Python; bench/launch_cost_bench.cu times the bare launch beside it. Run on the GPU
// machine:   build-gpu/bench/native_call_bench [--iters 2000] [--tokens 8]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/check_cuda.h"
#include "runtime/bootstrap.h"
#include "runtime/gpu_buffer.h"
#include "runtime/validate.h"

namespace {

using Clock = std::chrono::steady_clock;

template <typename T>
T* DeviceArray(size_t n) {
  void* p = nullptr;
  LLEP_BENCH_CHECK_CUDA(cudaMalloc(&p, n * sizeof(T)));
  LLEP_BENCH_CHECK_CUDA(cudaMemset(p, 0, n * sizeof(T)));
  return static_cast<T*>(p);
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 2000, T = 8;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--iters") == 0) iters = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--tokens") == 0) T = std::atoi(argv[i + 1]);
  }
  const int H = 7168, E = 256, K = 8, R = 1;
  LLEP_BENCH_CHECK_CUDA(cudaSetDevice(0));
  auto bootstrap = llep::MakeCallbackBootstrap(
      0, 1, [](const std::string& blob) -> absl::StatusOr<std::vector<std::string>> { return {{blob}}; });
  llep::GpuBufferOptions opt;
  opt.device = 0;
  auto made = llep::GpuBuffer::Create(llep::protocol::LlShape{T, H, E, R}, *bootstrap, opt);
  LLEP_BENCH_CHECK_OK(made.status());
  std::unique_ptr<llep::GpuBuffer> buf = *std::move(made);

  // Inputs: token t selects experts (t + 32 k) % E, k < K; outputs sized for R * T rows per local expert.
  std::vector<int64_t> ids(static_cast<size_t>(T) * K);
  for (int t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) ids[static_cast<size_t>(t) * K + k] = (t + 32 * k) % E;
  }
  auto* topk = DeviceArray<int64_t>(ids.size());
  LLEP_BENCH_CHECK_CUDA(cudaMemcpy(topk, ids.data(), ids.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
  const size_t rows = static_cast<size_t>(E / R) * R * T;
  llep::DispatchCall d;
  d.x = DeviceArray<uint16_t>(static_cast<size_t>(T) * H);
  d.topk_idx = topk;
  d.num_tokens = T;
  d.num_topk = K;
  d.mode.use_fp8 = true;
  d.recv_x = DeviceArray<uint8_t>(rows * H);
  d.recv_scales = DeviceArray<float>(rows * (H / 128));
  d.recv_count = DeviceArray<int32_t>(E / R);
  d.src_info = DeviceArray<int32_t>(rows);
  d.layout_range = DeviceArray<int64_t>(static_cast<size_t>(E / R) * R);
  llep::CombineCall c;
  c.x = DeviceArray<uint16_t>(rows * H);
  c.topk_idx = topk;
  c.topk_weights = DeviceArray<float>(static_cast<size_t>(T) * K);
  c.num_tokens = T;
  c.num_topk = K;
  c.layout_range = d.layout_range;
  c.out = DeviceArray<uint16_t>(static_cast<size_t>(T) * H);
  const auto median = [](std::vector<double> v) {
    std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
    return v[v.size() / 2];
  };
  cudaStream_t own;
  LLEP_BENCH_CHECK_CUDA(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
  // torch's default stream is the legacy one (handle 0), which a launch must order against every blocking stream.
  for (cudaStream_t s : {own, cudaStream_t{nullptr}}) {
    for (int i = 0; i < 20; ++i) {  // warm-up, and the calls are known to work
      LLEP_BENCH_CHECK_OK(buf->Dispatch(d, false, s).status());
      LLEP_BENCH_CHECK_OK(buf->Combine(c, false, s).status());
    }
    LLEP_BENCH_CHECK_CUDA(cudaStreamSynchronize(s));
    // Each call timed alone. The GPU stays busy ahead: a pair's kernels take longer (~25 µs at T = 8) than the host
    // takes to queue it, and a memset starts every batch behind some work; a batch stays below the launch queue's
    // depth.
    std::vector<double> t_d, t_c, t_set, t_err, t_val;
    for (int done = 0; done < iters;) {
      const int batch = std::min(200, iters - done);
      LLEP_BENCH_CHECK_CUDA(cudaMemsetAsync(const_cast<uint16_t*>(c.x), 0, rows * H * 2, s));
      for (int i = 0; i < batch; ++i) {
        auto t0 = Clock::now();
        LLEP_BENCH_CHECK_OK(buf->Dispatch(d, false, s).status());
        auto t1 = Clock::now();
        LLEP_BENCH_CHECK_OK(buf->Combine(c, false, s).status());
        auto t2 = Clock::now();
        LLEP_BENCH_CHECK_CUDA(cudaSetDevice(0));
        auto t3 = Clock::now();
        LLEP_BENCH_CHECK_OK(buf->CheckErrors(false));
        auto t4 = Clock::now();
        LLEP_BENCH_CHECK_OK(llep::ValidateDispatchCall(buf->layout().shape, d, opt.metrics_layers));
        auto t5 = Clock::now();
        t_d.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count());
        t_c.push_back(std::chrono::duration<double, std::nano>(t2 - t1).count());
        t_set.push_back(std::chrono::duration<double, std::nano>(t3 - t2).count());
        t_err.push_back(std::chrono::duration<double, std::nano>(t4 - t3).count());
        t_val.push_back(std::chrono::duration<double, std::nano>(t5 - t4).count());
      }
      LLEP_BENCH_CHECK_CUDA(cudaStreamSynchronize(s));
      done += batch;
    }
    std::printf(
        "native C++ call, T=%d, 1 rank, %s stream, ns per call (median of %d): GpuBuffer::Dispatch %.0f, Combine "
        "%.0f; parts: cudaSetDevice %.0f, CheckErrors (mutex + error record) %.0f, ValidateDispatchCall %.0f\n",
        T, s == own ? "a non-blocking" : "the legacy", iters, median(t_d), median(t_c), median(t_set), median(t_err),
        median(t_val));
  }
  LLEP_BENCH_CHECK_OK(buf->Close());
  return 0;
}
