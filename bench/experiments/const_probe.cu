// Probe: what a first access to a line of a kernel's parameter block costs (constant bank, per SM), and whether a
// line touched by another warp of the CTA first is then a hit. One CTA per SM; thread 0 of warp 0 times a dependent
// chain of LDCs with clock64. Run: nvcc -O3 -arch=sm_90a -I. -o /tmp/const_probe bench/experiments/const_probe.cu &&
// /tmp/const_probe (one GPU, seconds). Session 53 on H200: ~86 cycles per load in every case, first read or not
// (bench/RESULTS.md session 53, call 1).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench/experiments/probe_check.h"
struct P {
  uint32_t w[256];
  int zero;
  int pretouch;
};
__global__ void probe(const __grid_constant__ P p, long long* out) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (p.pretouch && warp == 1) {  // warp 1 touches every 64-byte line of w once
    uint32_t s = 0;
    for (int i = lane; i < 16; i += 32) s += p.w[i * 16 + 1];
    if (s == 0xdeadbeef) out[1000] = s;
  }
  if (warp == 0 && lane == 0) {
    long long start = clock64();
    while (clock64() - start < 4000) {
    }  // let warp 1's touches land first
    uint32_t v = 0;
    long long t[40];
    // pass 1: line 0 twice, then lines 1..15; pass 2: all again.
    constexpr int order[34] = {0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9,  10, 11, 12, 13, 14, 15,
                               0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 15};
#pragma unroll
    for (int k = 0; k < 34; ++k) {
      const long long a = clock64();
      v = p.w[order[k] * 16 + (v & p.zero) + 2];
      v += 1;
      asm volatile("" ::"r"(v));
      const long long b = clock64();
      t[k] = b - a;
    }
#pragma unroll
    for (int k = 0; k < 34; ++k) out[blockIdx.x * 40 + k] = t[k];
    out[blockIdx.x * 40 + 39] = v;
  }
}
int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (sms > 200) sms = 200;  // out holds 40 words per CTA for 200 CTAs
  long long* d = nullptr;
  CK(cudaMalloc(&d, sizeof(long long) * 40 * 200 + 8192));
  std::vector<long long> h(40 * 200);
  P p{};
  for (int i = 0; i < 256; ++i) p.w[i] = i;
  for (int pre = 0; pre < 2; ++pre) {
    p.pretouch = pre;
    for (int rep = 0; rep < 4; ++rep) {
      probe<<<sms, 64>>>(p, d);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
    }
    CK(cudaMemcpy(h.data(), d, sizeof(long long) * 40 * sms, cudaMemcpyDeviceToHost));
    printf("pretouch=%d (cycles per dependent LDC; line order 0 0 1..15 | 0..15 15), CTA 0 / CTA %d:\n", pre, sms / 2);
    for (int b : {0, sms / 2}) {
      for (int k = 0; k < 34; ++k) printf("%lld ", h[b * 40 + k]);
      printf("\n");
    }
  }
  CK(cudaFree(d));
  return 0;
}
