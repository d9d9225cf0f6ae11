// The GPU→CPU command ring shared by producers (CUDA warps now, CPU backend threads in CI) and one proxy thread.
// Layer: runtime/protocol. Producer: FifoPush() below (host and device). Consumer: proxy/fifo_consumer.h.
//
// Memory (GPU build): ring and tail in pinned host memory mapped into the GPU, head and tail_cache in device
// memory so the slot-claim atomic never crosses PCIe (UCCL's measured 25x lesson). CPU build: all host memory.
// Ordering: producer claims idx = head++ (relaxed), writes w0, then release-stores w1 with the commit bit of
// lap idx / size; the consumer acquire-loads w1 (pairs with the release store below), then reads w0, and
// release-stores tail when it frees slots (pairs with the acquire load of tail in FifoPush). A commit bit,
// not a zeroed slot, marks validity, so the consumer never writes to ring memory.
#pragma once

#include <cstdint>

#include "runtime/protocol/fifo_cmd.h"
#include "runtime/protocol/hd.h"
#include "runtime/protocol/sys_order.h"

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
#else
inline void FifoStoreRelaxed(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
inline uint64_t FifoClaim(uint64_t* head) { return __atomic_fetch_add(head, 1, __ATOMIC_RELAXED); }
inline uint64_t FifoLoadRelaxed(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline void FifoBackoff() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
#endif

/// Pushes `cmd` (commit bit ignored). Waits while the ring is full; returns false only if the abort flag was
/// raised while waiting, in which case the claimed slot stays empty and the consumer must be torn down.
LLEP_HD bool FifoPush(const FifoRingHandle& f, FifoCmd cmd) {
  const uint64_t idx = FifoClaim(f.head);
  uint64_t tail_lb = FifoLoadRelaxed(f.tail_cache);
  while (idx - tail_lb >= f.size) {
    tail_lb = LoadAcquireSys(f.tail);  // pairs with the consumer's release store of tail
    FifoStoreRelaxed(f.tail_cache, tail_lb);
    if (idx - tail_lb < f.size) break;
    if (*f.abort_flag != 0) return false;
    FifoBackoff();
  }
  FifoCmd* slot = &f.ring[idx & (f.size - 1)];
  FifoStoreRelaxed(&slot->w0, cmd.w0);
  StoreReleaseSys(&slot->w1, (cmd.w1 & ~kCmdCommitBit) | ExpectedCommit(idx, f.size));
  return true;
}

}  // namespace llep::protocol
