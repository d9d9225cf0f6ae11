// Diagnostic (not part of llep, not built by CMake; bench/experiments/README.md): does a launch's time depend on where
// its code lies, with the code itself identical? Sessions 47-51 saw the settled hook dispatch receive move by 0.2-0.6
// us when only its offset in its module changed (the kernel's .text byte-identical). This probe puts kCopies copies of
// one straight-line kernel (`victim`, ~3,000 instructions run once by every warp of 33 CTAs, as a small-T
// receive's) at different offsets in one module and times each copy. ptxas lays the copies out one after another,
// 0xb680 bytes apart (sm_90a, CUDA 13.0), so all eight offsets differ modulo 4 KiB and every larger power of two:
//   warm   - right after the same copy ran (its lines in the SMs' instruction caches);
//   evict  - after `evict` (~1 MiB of straight-line code run by every SM), so the copy's lines come from L2;
//   flush  - after a 256 MiB memset as well (L2 flushed), so they come from device memory.
// Per launch: the span from the first CTA's first stamp to the last CTA's end (globaltimer; it leaves out the launch
// latency but not the instruction fetches after the first line) and the CUDA-event time around the launch alone.
// Medians over kReps. If `evict` differs between copies by tenths of a microsecond, placement reaches a receive's
// time through fetches from L2; if only `flush` does, through device memory; if neither, look at the other kernels'
// code (the copies' neighbours in the real modules) next.
//   nvcc -O3 -arch=sm_90a -std=c++17 -I. -o /tmp/code_placement_probe bench/experiments/code_placement_probe.cu
//   /tmp/code_placement_probe            # one GPU, seconds
//   nvcc -O3 -arch=sm_90a -std=c++17 -I. -cubin -o /tmp/probe.cubin bench/experiments/code_placement_probe.cu
//   readelf -SW /tmp/probe.cubin | grep "text.*victim"   # each copy's offset (and size) in the module
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench/experiments/probe_check.h"
#include "runtime/protocol/gpu_port.h"

namespace {

// One warp per SM sub-partition: its ~2,900 instructions issue in ~1.5 us, so the fetches are not hidden behind other
// warps' issue (16 warps, as the receive's CTA, would issue for ~6 us).
constexpr int kThreads = 128, kVictimCtas = 33, kReps = 200;
constexpr int kVictimMads = 720;  // four chains: ~2,900 instructions, ~46 KiB of code

/// n rounds of four independent multiply-adds on values ptxas cannot know: 4n instructions it keeps, in line.
template <int kN>
__device__ __forceinline__ uint32_t Straight(uint32_t a, uint32_t m) {
  uint32_t b = a ^ 0x9e3779b9u, c = a + 7u, d = a * 3u;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    asm volatile("mad.lo.u32 %0, %0, %1, %2;" : "+r"(a) : "r"(m), "r"(b));
    asm volatile("mad.lo.u32 %0, %0, %1, %2;" : "+r"(b) : "r"(m), "r"(c));
    asm volatile("mad.lo.u32 %0, %0, %1, %2;" : "+r"(c) : "r"(m), "r"(d));
    asm volatile("mad.lo.u32 %0, %0, %1, %2;" : "+r"(d) : "r"(m), "r"(a));
  }
  return a ^ b ^ c ^ d;
}

/// span[0] = min over CTAs of their start, span[1] = max of their end (reset to {~0, 0} before each launch).
template <int kCopy>
__global__ void __launch_bounds__(kThreads) victim(const uint32_t* in, uint32_t* sink, unsigned long long* span) {
  const uint64_t t0 = llep::gpu::GlobalTimerNs();
  const uint32_t v = Straight<kVictimMads>(in[0] + threadIdx.x, in[1]);
  if (v == 0x12345678u) sink[kCopy] = v;  // keeps the chains; never true for the inputs below
  __syncthreads();
  if (threadIdx.x == 0) {
    atomicMin(span, static_cast<unsigned long long>(t0));
    atomicMax(span + 1, static_cast<unsigned long long>(llep::gpu::GlobalTimerNs()));
  }
}

/// ~1 MiB of code run by every SM: the victims' lines leave the SMs' instruction caches (not L2).
__global__ void __launch_bounds__(128) evict(const uint32_t* in, uint32_t* sink) {
  const uint32_t v = Straight<16384>(in[0] + threadIdx.x, in[1]);
  if (v == 0x12345678u) sink[63] = v;
}

__global__ void reset(unsigned long long* span) {
  span[0] = ~0ull;
  span[1] = 0;
}

using VictimFn = void (*)(const uint32_t*, uint32_t*, unsigned long long*);
const VictimFn kVictims[] = {victim<0>, victim<1>, victim<2>, victim<3>, victim<4>, victim<5>, victim<6>, victim<7>};
constexpr int kCopies = sizeof(kVictims) / sizeof(kVictims[0]);

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  uint32_t *in, *sink;
  unsigned long long* spans;
  uint8_t* big;
  const size_t big_bytes = size_t{256} << 20;
  CK(cudaMalloc(&in, 8));
  CK(cudaMalloc(&sink, 64 * 4));
  CK(cudaMalloc(&spans, sizeof(unsigned long long) * 2 * kReps));
  CK(cudaMalloc(&big, big_bytes));
  const uint32_t host_in[2] = {12345u, 2654435761u};
  CK(cudaMemcpy(in, host_in, 8, cudaMemcpyHostToDevice));
  std::vector<cudaEvent_t> ev(2 * kReps);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  // Warm-up: every kernel once (module load, first-launch costs).
  for (VictimFn f : kVictims) {
    reset<<<1, 1, 0, s>>>(spans);
    f<<<kVictimCtas, kThreads, 0, s>>>(in, sink, spans);
  }
  evict<<<264, 128, 0, s>>>(in, sink);
  CK(cudaStreamSynchronize(s));

  printf("copy | span warm / evict / flush (us) | event warm / evict / flush (us)\n");
  for (int k = 0; k < kCopies; ++k) {
    double span_med[3], event_med[3];
    for (int mode = 0; mode < 3; ++mode) {
      for (int r = 0; r < kReps; ++r) {
        if (mode == 0) kVictims[k]<<<kVictimCtas, kThreads, 0, s>>>(in, sink, spans + 2 * r);  // itself, just before
        if (mode == 2) CK(cudaMemsetAsync(big, r & 0xff, big_bytes, s));
        if (mode >= 1) evict<<<264, 128, 0, s>>>(in, sink);
        reset<<<1, 1, 0, s>>>(spans + 2 * r);
        CK(cudaEventRecord(ev[2 * r], s));
        kVictims[k]<<<kVictimCtas, kThreads, 0, s>>>(in, sink, spans + 2 * r);
        CK(cudaEventRecord(ev[2 * r + 1], s));
      }
      CK(cudaStreamSynchronize(s));
      std::vector<unsigned long long> h(2 * kReps);
      CK(cudaMemcpy(h.data(), spans, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
      std::vector<double> sp(kReps), et(kReps);
      for (int r = 0; r < kReps; ++r) {
        sp[r] = (h[2 * r + 1] - h[2 * r]) * 1e-3;
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, ev[2 * r], ev[2 * r + 1]));
        et[r] = ms * 1e3;
      }
      span_med[mode] = Median(sp);
      event_med[mode] = Median(et);
    }
    printf("%4d | %5.2f / %5.2f / %5.2f | %5.2f / %5.2f / %5.2f\n", k, span_med[0], span_med[1], span_med[2],
           event_med[0], event_med[1], event_med[2]);
  }
  return 0;
}
