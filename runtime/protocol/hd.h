// LLEP_HD marks functions callable from host and device code. Protocol headers use it so the CUDA kernels,
// the CPU backend and the proxy compile the same definitions. This header depends on nothing but <cstdint>.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define LLEP_HD __host__ __device__ __forceinline__
#else
#define LLEP_HD inline
#endif

namespace llep::protocol {

/// A 64-bit word made of two 32-bit halves: signal words, FIFO command offsets, layout ranges and the call record's
/// counters all pack this way. The only place the shift is spelled out.
LLEP_HD constexpr uint64_t JoinHalves(uint32_t high, uint32_t low) { return (uint64_t{high} << 32) | low; }
LLEP_HD constexpr uint32_t HighHalf(uint64_t word) { return static_cast<uint32_t>(word >> 32); }
LLEP_HD constexpr uint32_t LowHalf(uint64_t word) { return static_cast<uint32_t>(word); }

}  // namespace llep::protocol
