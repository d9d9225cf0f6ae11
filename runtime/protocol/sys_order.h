// The two memory-order primitives every llep handoff is built on, for host and device code alike: a
// system-scope acquire load and release store of a 64-bit word. Signal words (signal.h), FIFO commands and the
// FIFO tail (fifo_ring.h) are published and observed only through these. Layer: runtime/protocol.
//
// On an NVIDIA GPU they are ld.acquire.sys / st.release.sys (visible to peers over NVLink and to the host), on an AMD
// GPU the system-scope HIP atomics; on the CPU the C++ acquire/release atomics, which pair with them through coherent
// mapped memory.
#pragma once

#include <cstdint>

#include "runtime/protocol/hd.h"

namespace llep::protocol {

#if defined(__CUDA_ARCH__)
__device__ __forceinline__ uint64_t LoadAcquireSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void StoreReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
#else
#if defined(__HIP__)
__device__ __forceinline__ uint64_t LoadAcquireSys(const uint64_t* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
__device__ __forceinline__ void StoreReleaseSys(uint64_t* p, uint64_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
#endif
LLEP_CPU uint64_t LoadAcquireSys(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
LLEP_CPU void StoreReleaseSys(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
#endif

}  // namespace llep::protocol
