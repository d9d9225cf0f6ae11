// Diagnostic (not part of llep, not built by CMake; bench/experiments/README.md): what a dependent global load costs
// when its page's translation is cold. chase: one thread follows a chain of n pointers (ld.global.cg), each in its own
// 2 MiB page (A) or all in one page (B), lines already in L2; before each chase, `touch` writes one line in each of
// many other pages (evicting TLB entries, hardly any L2). Prints median ns per load over reps.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench/experiments/probe_check.h"
__device__ __forceinline__ uint64_t gt() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
__global__ void chase(uint64_t* start, int n, uint64_t* out) {
  uint64_t p = reinterpret_cast<uint64_t>(start);
  const uint64_t t0 = gt();
  for (int i = 0; i < n; ++i) asm volatile("ld.global.cg.u64 %0, [%0];" : "+l"(p));
  const uint64_t t1 = gt();
  out[0] = t1 - t0;
  out[1] = p;
}
__global__ void touch(uint8_t* big, size_t pages, size_t page) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < pages; i += gridDim.x * blockDim.x)
    reinterpret_cast<volatile uint32_t*>(big + i * page + 4096)[0] += 1;
}
int main() {
  const size_t MB2 = size_t{2} << 20, n = 8;
  uint8_t *chainA, *chainB, *big;
  uint64_t* out;
  const size_t big_pages = 8192;  // 16 GiB, one line each
  CK(cudaMalloc(&chainA, MB2 * 64));
  CK(cudaMalloc(&chainB, MB2 * 4));
  CK(cudaMalloc(&big, MB2 * big_pages));
  CK(cudaMalloc(&out, 16));
  CK(cudaMemset(big, 0, MB2 * big_pages));
  std::vector<uint64_t> host(1);
  // A: element i at chainA + (4 i + 1) * 2 MiB + 128 i; B: element i at chainB + 2 MiB... within one 2 MiB page: 64 KiB
  // apart
  auto addrA = [&](size_t i) { return chainA + (4 * i + 1) * MB2 + 128 * i; };
  auto addrB = [&](size_t i) { return chainB + MB2 + 65536 * i; };
  for (size_t i = 0; i < n; ++i) {
    uint64_t nextA = reinterpret_cast<uint64_t>(i + 1 < n ? addrA(i + 1) : addrA(0));
    uint64_t nextB = reinterpret_cast<uint64_t>(i + 1 < n ? addrB(i + 1) : addrB(0));
    CK(cudaMemcpy(addrA(i), &nextA, 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(addrB(i), &nextB, 8, cudaMemcpyHostToDevice));
  }
  const int reps = 30;
  for (int mode = 0; mode < 4; ++mode) {
    std::vector<double> ns;
    for (int r = 0; r < reps; ++r) {
      uint64_t* start = reinterpret_cast<uint64_t*>(mode % 2 == 0 ? addrA(0) : addrB(0));
      chase<<<1, 1>>>(start, n, out);                          // lines into L2, translations warm
      if (mode < 2) touch<<<264, 256>>>(big, big_pages, MB2);  // modes 0/1: translations thrashed
      chase<<<1, 1>>>(start, n, out);
      CK(cudaDeviceSynchronize());
      uint64_t v[2];
      CK(cudaMemcpy(v, out, 16, cudaMemcpyDeviceToHost));
      ns.push_back(double(v[0]) / n);
    }
    std::sort(ns.begin(), ns.end());
    const char* names[] = {"distinct 2MiB pages, after thrash", "one page, after thrash", "distinct pages, warm",
                           "one page, warm"};
    printf("%-36s median %.0f ns/load (min %.0f, max %.0f)\n", names[mode], ns[reps / 2], ns[0], ns[reps - 1]);
  }
  return 0;
}
