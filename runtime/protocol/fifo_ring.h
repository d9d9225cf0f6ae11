// The GPU→CPU command ring shared by producers (CUDA warps now, CPU backend threads in CI) and one proxy thread.
// Layer: runtime/protocol. Producer: FifoPush() below (host and device). Consumer: proxy/fifo_consumer.h.
//
// Memory (GPU build): ring and tail in pinned host memory mapped into the GPU, head and tail_cache in device
// memory so the slot-claim atomic never crosses PCIe (UCCL's measured 25x lesson). CPU build: all host memory.
// Ordering: producer claims idx = head++ (relaxed) and publishes the slot with the commit bit of lap idx / size in
// w1; the consumer acquire-loads w1, then reads w0, and release-stores tail when it frees slots (pairs with the
// acquire load of tail in the producers). A commit bit, not a zeroed slot, marks validity, so the consumer never
// writes to ring memory. Publishing: on the CPU, w0 then a release store of w1; on the GPU, one 16-byte
// st.release.sys.v2.u64 of both words (one PCIe write per command, the slot is 16-byte aligned so it never
// straddles a write boundary; the release orders everything the thread, and through a preceding CTA barrier its
// CTA, wrote before, so staged payloads are visible before the command); on an AMD GPU, as on the CPU, w0 then a
// system-scope release store of w1 (HIP has no 16-byte release store).
// GPU producers that push several commands at once use FifoPushWarp: one claim atomic per warp and one release store
// instruction for all lanes (measured in bench/fifo_gpu_bench.cu and bench/RESULTS.md).
#pragma once

#include <cstdint>

#include "runtime/protocol/fifo_cmd.h"
#include "runtime/protocol/hd.h"
#include "runtime/protocol/sys_order.h"

#if defined(__CUDACC__) || defined(__HIP__)
#include "runtime/protocol/gpu_port.h"
#endif

namespace llep::protocol {

inline constexpr uint32_t kFifoRingVersion = 1;

struct FifoRingHandle {
  FifoCmd* ring;                       ///< `size` entries, zero-initialised.
  uint64_t* head;                      ///< Next index to claim (producers only).
  uint64_t* tail;                      ///< Next index the consumer will read (consumer writes, producers read).
  uint64_t* tail_cache;                ///< Producers' lower bound of *tail; any stale value is safe.
  const volatile int32_t* abort_flag;  ///< Non-zero: stop waiting for space (proxy died or user abort).
  uint32_t size;                       ///< Power of two.
};

/// Commit bit a valid command at index `idx` carries: 1 on even laps, 0 on odd laps, so zeroed memory (lap 0
/// expects 1) is never mistaken for a command.
LLEP_HD constexpr uint64_t ExpectedCommit(uint64_t idx, uint32_t size) {
  return ((idx / size) & 1) == 0 ? kCmdCommitBit : 0;
}

#if defined(__CUDA_ARCH__)
__device__ __forceinline__ void FifoStoreRelaxed(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t FifoClaim(uint64_t* head) {
  return atomicAdd(reinterpret_cast<unsigned long long*>(head), 1ull);
}
__device__ __forceinline__ uint64_t FifoLoadRelaxed(const uint64_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
}
__device__ __forceinline__ void FifoBackoff() { __nanosleep(64); }
/// Both words in one 16-byte release store: the slot becomes visible whole, after everything written before.
__device__ __forceinline__ void FifoPublish(FifoCmd* slot, uint64_t w0, uint64_t w1) {
  asm volatile("st.release.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(slot), "l"(w0), "l"(w1) : "memory");
}
#else
#if defined(__HIP__)
__device__ __forceinline__ void FifoStoreRelaxed(uint64_t* p, uint64_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
__device__ __forceinline__ uint64_t FifoClaim(uint64_t* head) {
  return atomicAdd(reinterpret_cast<unsigned long long*>(head), 1ull);
}
__device__ __forceinline__ uint64_t FifoLoadRelaxed(const uint64_t* p) {
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
__device__ __forceinline__ void FifoBackoff() { gpu::SleepNs(64); }
__device__ __forceinline__ void FifoPublish(FifoCmd* slot, uint64_t w0, uint64_t w1) {
  FifoStoreRelaxed(&slot->w0, w0);
  StoreReleaseSys(&slot->w1, w1);  // pairs with the consumer's acquire load of w1
}
#endif
LLEP_CPU void FifoStoreRelaxed(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
LLEP_CPU uint64_t FifoClaim(uint64_t* head) { return __atomic_fetch_add(head, 1, __ATOMIC_RELAXED); }
LLEP_CPU uint64_t FifoLoadRelaxed(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
LLEP_CPU void FifoBackoff() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
LLEP_CPU void FifoPublish(FifoCmd* slot, uint64_t w0, uint64_t w1) {
  __atomic_store_n(&slot->w0, w0, __ATOMIC_RELAXED);
  StoreReleaseSys(&slot->w1, w1);  // pairs with the consumer's acquire load of w1
}
#endif

/// Waits until slots [idx, idx + n) are free (the consumer's tail passed idx + n - size); false if the abort flag
/// was raised meanwhile.
LLEP_HD bool FifoWaitForSpace(const FifoRingHandle& f, uint64_t idx, uint32_t n) {
  uint64_t tail_lb = FifoLoadRelaxed(f.tail_cache);
  while (idx + n - tail_lb > f.size) {
    tail_lb = LoadAcquireSys(f.tail);  // pairs with the consumer's release store of tail
    FifoStoreRelaxed(f.tail_cache, tail_lb);
    if (idx + n - tail_lb <= f.size) break;
    if (*f.abort_flag != 0) return false;
    FifoBackoff();
  }
  return true;
}

/// Pushes `cmd` (commit bit ignored). Waits while the ring is full; returns false only if the abort flag was
/// raised while waiting, in which case the claimed slot stays empty and the consumer must be torn down.
LLEP_HD bool FifoPush(const FifoRingHandle& f, FifoCmd cmd) {
  const uint64_t idx = FifoClaim(f.head);
  if (!FifoWaitForSpace(f, idx, 1)) return false;
  FifoPublish(&f.ring[idx & (f.size - 1)], cmd.w0, (cmd.w1 & ~kCmdCommitBit) | ExpectedCommit(idx, f.size));
  return true;
}

#if defined(__CUDACC__) || defined(__HIP__)
/// Warp-collective push (every lane of the warp calls it; the warp must be converged): each lane with `active`
/// pushes `cmd`. One lane claims all the warp's slots with one atomic and waits for space (so at most one lane per
/// warp polls the host tail), then every active lane publishes its slot; commands keep lane order. Returns false on
/// every lane if the abort flag was raised while waiting (no slot is published then; the ring must be torn down).
/// With fewer than size / 32 producer warps per ring a claim never waits on itself.
__device__ __forceinline__ bool FifoPushWarp(const FifoRingHandle& f, FifoCmd cmd, bool active) {
  const unsigned mask = gpu::WarpBallot(active);
  if (mask == 0) return true;
  const int lane = gpu::WarpLane();
  const int leader = __ffs(mask) - 1;
  const uint32_t n = static_cast<uint32_t>(__popc(mask));
  unsigned long long base = 0;
  int ok = 1;
  if (lane == leader) {
    base = atomicAdd(reinterpret_cast<unsigned long long*>(f.head), static_cast<unsigned long long>(n));
    ok = FifoWaitForSpace(f, base, n) ? 1 : 0;
  }
  base = gpu::WarpShfl(base, leader);
  ok = gpu::WarpShfl(ok, leader);
  if (!ok) return false;
  if (active) {
    const uint64_t idx = base + static_cast<uint64_t>(__popc(mask & ((1u << lane) - 1u)));
    FifoPublish(&f.ring[idx & (f.size - 1)], cmd.w0, (cmd.w1 & ~kCmdCommitBit) | ExpectedCommit(idx, f.size));
  }
  return true;
}
#endif

}  // namespace llep::protocol
