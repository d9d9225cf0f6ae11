// LLEP_HD marks functions callable from host and device code. Protocol headers use it so the CUDA kernels,
// the CPU backend and the proxy compile the same definitions. This header depends on nothing but <cstdint> (and, when
// compiling HIP, the HIP runtime header that defines the attributes).
#pragma once

#include <cstdint>

#if defined(__HIP__)
#include <hip/hip_runtime.h>  // HIP's __host__ / __device__ / __forceinline__ (nvcc defines CUDA's itself)
#endif

#if defined(__CUDACC__) || defined(__HIP__)
#define LLEP_HD __host__ __device__ __forceinline__
#else
#define LLEP_HD inline
#endif

// LLEP_CPU marks the CPU definition of a function that also has a device definition (sys_order.h, fifo_ring.h). CUDA
// picks one per pass with __CUDA_ARCH__; HIP's clang resolves a device function's calls in the host pass too, so
// there both are declared, as host and device overloads.
#if defined(__HIP__)
#define LLEP_CPU __host__ inline
#else
#define LLEP_CPU inline
#endif

namespace llep::protocol {

/// A 64-bit word made of two 32-bit halves: signal words, FIFO command offsets, layout ranges and the call record's
/// counters all pack this way. The only place the shift is spelled out.
LLEP_HD constexpr uint64_t JoinHalves(uint32_t high, uint32_t low) { return (uint64_t{high} << 32) | low; }
LLEP_HD constexpr uint32_t HighHalf(uint64_t word) { return static_cast<uint32_t>(word >> 32); }
LLEP_HD constexpr uint32_t LowHalf(uint64_t word) { return static_cast<uint32_t>(word); }

}  // namespace llep::protocol
