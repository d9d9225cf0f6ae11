// Diagnostic (not part of llep, not built by CMake; bench/experiments/README.md): what it costs to make G CTAs' NVLink
// payload stores visible to a peer GPU, by the way the sender signals. The send's critical path at small T ends with
// one thread polling a completion counter and then a system-scope release store of the signal (kernels/cuda/
// ll_device_common.cuh PublishWhenDone): 1.0-1.9 us from `polled` to `published` in the send traces (bench/RESULTS.md
// sessions 25, 42). This probe measures that step against signals that need no poll.
//
// Two GPUs of one process (peer access), one persistent kernel on each, `rounds` ping-pong rounds. In round r GPU A's G
// CTAs each store a `bytes` message of words r into B's memory and signal; B's CTAs wait for round r (thread 0 of each
// CTA spinning on one word with ld.acquire.sys, as llep's receive CTAs do), check their message's first and last word,
// then send the same way to A; A's CTAs wait for B's round r. A's CTA 0 times the rounds (globaltimer): per round / 2
// is one way — stores, signal, visibility at the peer.
//   method 0 "publisher" (llep today): every CTA: barrier, fence.acq_rel.gpu and an add to a local counter; CTA 0's
//            thread 0 polls that counter up to G r, then st.release.sys r on the peer's word.
//   method 1 "remote release add": every CTA: barrier, then red.release.sys.add 1 on the peer's word (the receiver
//            waits for G r: arrival counting, as the proxy path does for unordered NICs).
//   method 2 "sys fence, relaxed remote add": every CTA: barrier, fence.acq_rel.sys, red.relaxed.sys.add 1.
//   method 3 "flag only": no payload (bytes ignored), method 0's signal: the floor of the signal round trip.
// A signal seen before its message's words is counted as stale (a protocol that may not be used: every method here is
// meant to be correct by the PTX memory model; the count checks it on the hardware).
//
//   nvcc -O2 -arch=sm_90a -std=c++17 -I. -o /tmp/release_probe bench/experiments/release_probe.cu && /tmp/release_probe
// prints one line per (method, G, bytes): median one-way ns over 5 launches of `rounds` rounds, and stale messages.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench/experiments/probe_check.h"
#include "runtime/protocol/gpu_port.h"
#include "runtime/protocol/sys_order.h"

namespace {

// llep's own primitives (runtime/protocol): the loads, fences and the release store the kernels use.
using llep::gpu::LoadAcquireGpu;
using llep::protocol::LoadAcquireSys;
using llep::protocol::StoreReleaseSys;
__device__ __forceinline__ uint64_t Now() { return llep::gpu::GlobalTimerNs(); }
// Not in llep (yet): the per-CTA remote adds this probe compares with the publisher.
__device__ __forceinline__ void AddReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void AddRelaxedSys(uint64_t* p, uint64_t v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

struct Side {
  uint8_t* peer_payload;      ///< the peer's receive area [G][bytes], written by this side
  uint64_t* peer_word;        ///< the peer's signal word
  const uint8_t* my_payload;  ///< this side's receive area, written by the peer
  uint64_t* my_word;          ///< this side's signal word, written by the peer
  uint64_t* local_ctr;        ///< method 0's completion counter (this GPU)
  unsigned long long* out;    ///< [0] ns of all rounds (CTA 0), [1] stale messages, [2] timeouts
};

constexpr uint64_t kTimeoutNs = 2000000000ull;

template <int M>
__device__ void Send(const Side& s, uint64_t r, int bytes) {
  const int G = gridDim.x;
  if (M != 3) {
    uint4* dst = reinterpret_cast<uint4*>(s.peer_payload + int64_t{blockIdx.x} * bytes);
    const uint32_t w = static_cast<uint32_t>(r);
    for (int i = threadIdx.x; i < bytes / 16; i += blockDim.x) dst[i] = make_uint4(w, w, w, w);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (M == 0 || M == 3) {
    llep::gpu::FenceAcqRelGpu();
    atomicAdd(reinterpret_cast<unsigned long long*>(s.local_ctr), 1ull);
    if (blockIdx.x == 0) {
      const uint64_t t0 = Now();
      while (LoadAcquireGpu(s.local_ctr) < uint64_t{static_cast<uint64_t>(G)} * r) {
        if (Now() - t0 > kTimeoutNs) {
          atomicAdd(&s.out[2], 1ull);
          break;
        }
      }
      StoreReleaseSys(s.peer_word, r);
    }
  } else if (M == 1) {
    AddReleaseSys(s.peer_word, 1);
  } else {
    llep::gpu::FenceAcqRelSys();
    AddRelaxedSys(s.peer_word, 1);
  }
}

template <int M>
__device__ void Wait(const Side& s, uint64_t r, int bytes) {
  if (threadIdx.x == 0) {
    const uint64_t target = (M == 0 || M == 3) ? r : uint64_t{gridDim.x} * r;
    const uint64_t t0 = Now();
    while (LoadAcquireSys(s.my_word) < target) {
      if (Now() - t0 > kTimeoutNs) {
        atomicAdd(&s.out[2], 1ull);
        break;
      }
    }
    if (M != 3) {
      const uint32_t* msg = reinterpret_cast<const uint32_t*>(s.my_payload + int64_t{blockIdx.x} * bytes);
      if (msg[0] != static_cast<uint32_t>(r) || msg[bytes / 4 - 1] != static_cast<uint32_t>(r)) {
        atomicAdd(&s.out[1], 1ull);
      }
    }
  }
  __syncthreads();
}

template <int M>
__global__ void PingPong(Side s, int rounds, int bytes, bool first) {
  const uint64_t t0 = Now();
  for (uint64_t r = 1; r <= static_cast<uint64_t>(rounds); ++r) {
    if (first) {
      Send<M>(s, r, bytes);
      Wait<M>(s, r, bytes);
    } else {
      Wait<M>(s, r, bytes);
      Send<M>(s, r, bytes);
    }
  }
  if (first && blockIdx.x == 0 && threadIdx.x == 0) s.out[0] = Now() - t0;
}

using Kernel = void (*)(Side, int, int, bool);
Kernel KernelOf(int m) {
  switch (m) {
    case 0:
      return PingPong<0>;
    case 1:
      return PingPong<1>;
    case 2:
      return PingPong<2>;
    default:
      return PingPong<3>;
  }
}

}  // namespace

int main() {
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  if (n < 2) {
    printf("release_probe: needs 2 GPUs (found %d)\n", n);
    return 1;
  }
  const int kMaxG = 64, kMaxBytes = 16384, kRounds = 2000, kThreads = 256;
  uint8_t* payload[2];
  uint64_t* words[2];  // [0] signal word, [1] local counter
  unsigned long long* out[2];
  for (int d = 0; d < 2; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaDeviceEnablePeerAccess(1 - d, 0));
    CK(cudaMalloc(&payload[d], size_t{kMaxG} * kMaxBytes));
    CK(cudaMalloc(&words[d], 2 * sizeof(uint64_t)));
    CK(cudaMalloc(&out[d], 3 * sizeof(unsigned long long)));
  }
  const char* names[] = {"publisher (llep)", "remote release add", "sys fence + relaxed add", "flag only"};
  printf("%-24s %4s %6s %12s %6s %8s\n", "method", "G", "bytes", "one-way ns", "stale", "timeouts");
  for (int m = 0; m < 4; ++m) {
    for (int G : {1, 2, 8, 32}) {
      for (int bytes : {7168, 14336}) {
        if (m == 3 && bytes != 7168) continue;
        std::vector<double> ns;
        unsigned long long stale = 0, timeouts = 0;
        for (int rep = 0; rep < 5; ++rep) {
          for (int d = 0; d < 2; ++d) {
            CK(cudaSetDevice(d));
            CK(cudaMemset(words[d], 0, 2 * sizeof(uint64_t)));
            CK(cudaMemset(payload[d], 0xff, size_t{kMaxG} * kMaxBytes));
            CK(cudaMemset(out[d], 0, 3 * sizeof(unsigned long long)));
            CK(cudaDeviceSynchronize());
          }
          for (int d = 0; d < 2; ++d) {
            CK(cudaSetDevice(d));
            const Side s{payload[1 - d], words[1 - d], payload[d], words[d], words[d] + 1, out[d]};
            KernelOf(m)<<<G, kThreads>>>(s, kRounds, bytes, d == 0);
            CK(cudaGetLastError());
          }
          unsigned long long h[2][3];
          for (int d = 0; d < 2; ++d) {
            CK(cudaSetDevice(d));
            CK(cudaDeviceSynchronize());
            CK(cudaMemcpy(h[d], out[d], sizeof(h[d]), cudaMemcpyDeviceToHost));
          }
          ns.push_back(static_cast<double>(h[0][0]) / kRounds / 2);
          stale += h[0][1] + h[1][1];
          timeouts += h[0][2] + h[1][2];
        }
        std::sort(ns.begin(), ns.end());
        printf("%-24s %4d %6d %12.0f %6llu %8llu\n", names[m], G, m == 3 ? 0 : bytes, ns[ns.size() / 2], stale,
               timeouts);
      }
    }
  }
  return 0;
}
