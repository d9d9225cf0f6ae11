// The host cost of the CUDA calls a low-latency call makes (issue #19 item 2: host CPU per call), one GPU, the GPU
// kept busy ahead so no call waits for the device: medians over `--iters` calls of each, in ns. What it answers: how
// much of the native dispatch / combine call (bench/host_path_breakdown.py's "native" rows) is the launch itself, what
// the cooperative attribute, a kernel-sized parameter block and dynamic shared memory add, what the driver's
// cuLaunchKernelEx saves over the runtime's cudaLaunchKernelEx, and what DeepEP's per-call stream hand-over
// (cudaEventRecord + cudaStreamWaitEvent, twice per call outside hook mode) costs. The kernels are empty (512
// threads, one CTA per SM, as llep's), so nothing here depends on llep's code. Run on the GPU machine:
//   build-gpu/bench/launch_cost_bench [--iters 2000]
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench/check_cuda.h"

namespace {

/// A parameter block the size of llep's DispatchParams (a few hundred bytes; kernels/cuda/ll_kernels.h).
struct BigParams {
  unsigned char bytes[768];
};

__global__ void __launch_bounds__(512, 1) EmptySmall(int) {}
__global__ void __launch_bounds__(512, 1) EmptyBig(BigParams p, int phase) {
  if (phase == 12345 && threadIdx.x == 0) printf("%d", p.bytes[blockIdx.x % 768]);  // keeps the parameter
}
__global__ void Spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

using Clock = std::chrono::steady_clock;

/// Median ns of `fn` over `iters` calls, the GPU kept busy ahead by a spin kernel long enough for all of them.
double Median(cudaStream_t s, int iters, const std::function<void()>& fn) {
  std::vector<double> ns;
  ns.reserve(iters);
  for (int done = 0; done < iters;) {
    const int batch = std::min(400, iters - done);  // stays below the launch queue's depth
    Spin<<<1, 1, 0, s>>>(2'000'000'000LL / 50);     // ~20 ms at ~2 GHz
    for (int i = 0; i < batch; ++i) {
      const auto t0 = Clock::now();
      fn();
      ns.push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
    }
    LLEP_BENCH_CHECK_CUDA(cudaStreamSynchronize(s));
    done += batch;
  }
  std::nth_element(ns.begin(), ns.begin() + ns.size() / 2, ns.end());
  return ns[ns.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 2000;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--iters") == 0) iters = std::atoi(argv[i + 1]);
  }
  LLEP_BENCH_CHECK_CUDA(cudaSetDevice(0));
  cudaDeviceProp prop{};
  LLEP_BENCH_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int G = prop.multiProcessorCount;
  cudaStream_t s;
  LLEP_BENCH_CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int smem = 64 * 1024;  // llep's dynamic shared memory is of this order at E = 256
  LLEP_BENCH_CHECK_CUDA(cudaFuncSetAttribute(EmptyBig, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t ev;
  LLEP_BENCH_CHECK_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  BigParams big{};
  const auto launch_ex = [&](bool coop, bool with_smem) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(G);
    cfg.blockDim = dim3(512);
    cfg.dynamicSmemBytes = with_smem ? smem : 0;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeCooperative;
    attr[0].val.cooperative = coop ? 1 : 0;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    LLEP_BENCH_CHECK_CUDA(cudaLaunchKernelEx(&cfg, EmptyBig, big, 0));
  };
  // The driver's launch with the runtime's function handle (no per-call symbol lookup in the runtime).
  cudaFunction_t fn_rt = nullptr;
  LLEP_BENCH_CHECK_CUDA(cudaGetFuncBySymbol(&fn_rt, reinterpret_cast<const void*>(EmptyBig)));
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult q{};
  LLEP_BENCH_CHECK_CUDA(cudaGetDriverEntryPointByVersion("cuLaunchKernelEx", &entry, 12000, cudaEnableDefault, &q));
  using LaunchFn = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
  const auto cu_launch = reinterpret_cast<LaunchFn>(entry);
  int zero = 0;
  const auto launch_drv = [&](bool coop) {
    CUlaunchConfig cfg = {};
    cfg.gridDimX = G;
    cfg.gridDimY = cfg.gridDimZ = 1;
    cfg.blockDimX = 512;
    cfg.blockDimY = cfg.blockDimZ = 1;
    cfg.sharedMemBytes = smem;
    cfg.hStream = reinterpret_cast<CUstream>(s);
    CUlaunchAttribute attr[1];
    attr[0].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attr[0].value.cooperative = coop ? 1 : 0;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    void* args[] = {&big, &zero};
    if (cu_launch(&cfg, reinterpret_cast<CUfunction>(fn_rt), args, nullptr) != CUDA_SUCCESS) std::exit(2);
  };

  struct Row {
    std::string name;
    std::function<void()> fn;
  };
  int dev = -1;
  cudaStreamCaptureStatus cap;
  const std::vector<Row> rows = {
      {"cudaGetDevice", [&] { LLEP_BENCH_CHECK_CUDA(cudaGetDevice(&dev)); }},
      {"cudaSetDevice (already current)", [&] { LLEP_BENCH_CHECK_CUDA(cudaSetDevice(0)); }},
      {"cudaStreamIsCapturing", [&] { LLEP_BENCH_CHECK_CUDA(cudaStreamIsCapturing(s, &cap)); }},
      {"cudaEventRecord + cudaStreamWaitEvent",
       [&] {
         LLEP_BENCH_CHECK_CUDA(cudaEventRecord(ev, s));
         LLEP_BENCH_CHECK_CUDA(cudaStreamWaitEvent(s, ev, 0));
       }},
      {"<<<G, 512>>> 4-byte params", [&] { EmptySmall<<<G, 512, 0, s>>>(0); }},
      {"cudaLaunchKernelEx 772-byte params", [&] { launch_ex(false, false); }},
      {"cudaLaunchKernelEx 772 B + 64 KiB smem", [&] { launch_ex(false, true); }},
      {"cudaLaunchKernelEx 772 B + smem, cooperative", [&] { launch_ex(true, true); }},
      {"cuLaunchKernelEx 772 B + smem", [&] { launch_drv(false); }},
      {"cuLaunchKernelEx 772 B + smem, cooperative", [&] { launch_drv(true); }},
  };
  std::printf("launch_cost_bench: %s, %d SMs, %d iterations per row, host ns (median)\n", prop.name, G, iters);
  for (int round = 0; round < 2; ++round) {  // the second round is the one to quote (warm caches, clocks up)
    for (const Row& r : rows) {
      const double ns = Median(s, iters, r.fn);
      if (round == 1) std::printf("  %-48s %8.0f\n", r.name.c_str(), ns);
    }
  }
  LLEP_BENCH_CHECK_CUDA(cudaDeviceSynchronize());
  return 0;
}
