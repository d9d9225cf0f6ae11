// The GPU portability layer: the few device intrinsics and memory-order primitives llep's kernels and the GPU FIFO
// use, for CUDA (NVIDIA) and HIP (AMD) from one source (design: kernels/HIP_PORT.md). Layer: kernels (device).
//
// Under CUDA every helper is the intrinsic or PTX instruction the kernels used before this header existed, inlined,
// so the CUDA build's machine code is unchanged (checked by comparing nvcc -cubin output before and after).
//
// Lanes: llep's "warp" is a group of 32 lanes on both vendors. Its per-lane layouts are part of the data path (a
// lane moves 16 bytes, so a warp pass is 512 bytes; 8 lanes share an FP8 scale group of 128 channels; lanes 0..4
// write the 80-byte message header), and keeping them one definition is worth more than wider warps. On CDNA a
// wavefront has 64 lanes, so it holds two logical warps (lanes 0..31 and 32..63): every collective below acts on the
// caller's half only — ballots return the caller's 32 bits, shuffles take a source lane 0..31 inside the caller's
// half (width 32), reductions and match-any stay in the half. The lane arithmetic is in `wave64` below as plain
// functions, unit-tested on the host by emulating a 64-lane wavefront (runtime/protocol/gpu_port_test.cc).
#pragma once

#include <cstdint>

#if defined(__HIP__)  // clang compiling HIP (hipcc, or clang -x hip)
#define LLEP_GPU_HIP 1
#include <hip/hip_runtime.h>
#elif defined(__CUDACC__)
#define LLEP_GPU_CUDA 1
#include <cuda_runtime.h>
#endif

namespace llep::gpu {

/// Lanes in a logical warp (both vendors).
inline constexpr int kWarpLanes = 32;
/// A logical warp's lane mask: bit i = lane i.
inline constexpr unsigned kFullWarp = 0xFFFFFFFFu;

/// Lane arithmetic for two 32-lane logical warps in one 64-lane wavefront (CDNA). Pure functions of a lane number
/// in the wavefront (0..63): the device helpers below use them, the host test checks them against a model.
namespace wave64 {
/// The caller's logical-warp bits of a wavefront ballot.
constexpr unsigned HalfMask(uint64_t wave_ballot, int wave_lane) {
  return static_cast<unsigned>(wave_ballot >> (wave_lane & 32));
}
/// Wavefront lane of logical lane `src` (0..31) in the caller's logical warp.
constexpr int ShflSource(int wave_lane, int src) { return (wave_lane & 32) | (src & 31); }
/// Source lane of a shift-up by `delta` (CUDA __shfl_up_sync: lanes below delta keep their own value).
constexpr int ShflUpSource(int wave_lane, int delta) {
  return (wave_lane & 31) >= delta ? wave_lane - delta : wave_lane;
}
/// Source lane of a butterfly exchange with `mask` (< 32) inside the caller's logical warp.
constexpr int ShflXorSource(int wave_lane, int mask) { return wave_lane ^ (mask & 31); }
}  // namespace wave64

#if defined(LLEP_GPU_CUDA) || defined(LLEP_GPU_HIP)

/// The lane of the calling thread in its logical warp.
__device__ __forceinline__ int WarpLane() { return static_cast<int>(threadIdx.x % kWarpLanes); }

#if defined(LLEP_GPU_CUDA)

__device__ __forceinline__ unsigned WarpBallot(bool p) { return __ballot_sync(kFullWarp, p); }
__device__ __forceinline__ bool WarpAny(bool p) { return __any_sync(kFullWarp, p) != 0; }
template <typename T>
__device__ __forceinline__ T WarpShfl(T v, int src) {
  return __shfl_sync(kFullWarp, v, src);
}
template <typename T>
__device__ __forceinline__ T WarpShflUp(T v, int delta) {
  return __shfl_up_sync(kFullWarp, v, delta);
}
template <typename T>
__device__ __forceinline__ T WarpShflXor(T v, int mask) {
  return __shfl_xor_sync(kFullWarp, v, mask);
}
/// Sum over the logical warp (every lane gets it).
__device__ __forceinline__ unsigned WarpSum(unsigned v) { return __reduce_add_sync(kFullWarp, v); }
__device__ __forceinline__ int WarpSum(int v) { return __reduce_add_sync(kFullWarp, v); }
/// Lanes of the logical warp holding the same value as the caller.
__device__ __forceinline__ unsigned WarpMatchAny(int v) { return __match_any_sync(kFullWarp, v); }
__device__ __forceinline__ void WarpSync() { __syncwarp(); }

/// Acquire-release fence at system scope (peers over NVLink, the host).
__device__ __forceinline__ void FenceAcqRelSys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
/// Acquire-release fence at GPU scope (ordering for threads of this GPU).
__device__ __forceinline__ void FenceAcqRelGpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
/// Nanoseconds of the GPU's global timer (metrics stamps, timeouts).
__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
/// Acquire load at GPU scope (completion counters other CTAs of the launch add to).
__device__ __forceinline__ uint64_t LoadAcquireGpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
/// Fetch-add of 1 with acquire-release order at GPU scope; returns the value before.
__device__ __forceinline__ uint64_t FetchAddAcqRelGpu(uint64_t* p) {
  uint64_t before;
  asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;" : "=l"(before) : "l"(p) : "memory");
  return before;
}
/// Single-copy-atomic 64-bit accesses at system scope with no ordering: a word a peer may read while it is being
/// written, whose content says whether it is current (protocol::PackRouteCount), so it never reads half of one.
__device__ __forceinline__ uint64_t LoadRelaxedSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ void StoreRelaxedSys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
/// Loads bypassing the SM's L1 (data other launches or CTAs rewrite).
template <typename T>
__device__ __forceinline__ T LoadCg(const T* p) {
  return __ldcg(p);
}
/// Backs off a polling thread for about `ns` nanoseconds.
__device__ __forceinline__ void SleepNs(unsigned ns) { __nanosleep(ns); }

#else  // LLEP_GPU_HIP

// Wavefront collectives restricted to the caller's logical warp (see the header comment), built on ds_bpermute (a
// lane reads any lane's register) with the source lanes of `wave64`, so the index arithmetic the host test checks is
// the arithmetic that runs.
__device__ __forceinline__ int WaveLane() { return static_cast<int>(__lane_id()); }
__device__ __forceinline__ unsigned WarpBallot(bool p) { return wave64::HalfMask(__ballot(p), WaveLane()); }
__device__ __forceinline__ bool WarpAny(bool p) { return WarpBallot(p) != 0; }
/// v of wavefront lane `wave_src`, for 4- and 8-byte types.
template <typename T>
__device__ __forceinline__ T Bpermute(T v, int wave_src) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "Bpermute moves 4- or 8-byte values");
  if constexpr (sizeof(T) == 4) {
    return __builtin_bit_cast(T, __builtin_amdgcn_ds_bpermute(wave_src << 2, __builtin_bit_cast(int, v)));
  } else {
    const auto w = __builtin_bit_cast(unsigned long long, v);
    const int lo = __builtin_amdgcn_ds_bpermute(wave_src << 2, static_cast<int>(w));
    const int hi = __builtin_amdgcn_ds_bpermute(wave_src << 2, static_cast<int>(w >> 32));
    return __builtin_bit_cast(
        T, (static_cast<unsigned long long>(static_cast<unsigned>(hi)) << 32) | static_cast<unsigned>(lo));
  }
}
template <typename T>
__device__ __forceinline__ T WarpShfl(T v, int src) {
  return Bpermute(v, wave64::ShflSource(WaveLane(), src));
}
template <typename T>
__device__ __forceinline__ T WarpShflUp(T v, int delta) {
  return Bpermute(v, wave64::ShflUpSource(WaveLane(), delta));
}
template <typename T>
__device__ __forceinline__ T WarpShflXor(T v, int mask) {
  return Bpermute(v, wave64::ShflXorSource(WaveLane(), mask));
}
/// Butterfly sum inside the logical warp (gpu_port_test.cc runs the same steps on an emulated wavefront).
template <typename T>
__device__ __forceinline__ T WarpSumT(T v) {
#pragma unroll
  for (int o = kWarpLanes / 2; o > 0; o >>= 1) v += WarpShflXor(v, o);
  return v;
}
__device__ __forceinline__ unsigned WarpSum(unsigned v) { return WarpSumT(v); }
__device__ __forceinline__ int WarpSum(int v) { return WarpSumT(v); }
/// Peels one value per step: the lowest lane not yet matched broadcasts its value, the lanes holding it take the
/// ballot. At most as many steps as distinct values in the logical warp (gpu_port_test.cc emulates it).
__device__ __forceinline__ unsigned WarpMatchAny(int v) {
  unsigned left = WarpBallot(true), mine = 0;
  while (left != 0) {
    const int leader = __ffs(left) - 1;
    const int lv = WarpShfl(v, leader);
    const unsigned same = WarpBallot(v == lv);
    if (v == lv) mine = same;
    left &= ~same;
  }
  return mine;
}
/// A wavefront executes its lanes together: only the compiler must not move memory operations across this point.
__device__ __forceinline__ void WarpSync() { __builtin_amdgcn_wave_barrier(); }

__device__ __forceinline__ void FenceAcqRelSys() { __builtin_amdgcn_fence(__ATOMIC_ACQ_REL, ""); }
__device__ __forceinline__ void FenceAcqRelGpu() { __builtin_amdgcn_fence(__ATOMIC_ACQ_REL, "agent"); }
/// s_memrealtime counts a constant 100 MHz on CDNA (not the shader clock): 10 ns per tick.
__device__ __forceinline__ uint64_t GlobalTimerNs() { return __builtin_amdgcn_s_memrealtime() * 10ull; }
__device__ __forceinline__ uint64_t LoadAcquireGpu(const uint64_t* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ __forceinline__ uint64_t FetchAddAcqRelGpu(uint64_t* p) {
  return __hip_atomic_fetch_add(p, uint64_t{1}, __ATOMIC_ACQ_REL, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ __forceinline__ uint64_t LoadRelaxedSys(const uint64_t* p) {
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
__device__ __forceinline__ void StoreRelaxedSys(uint64_t* p, uint64_t v) {
  __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
/// CDNA's vector L1 is not coherent across CUs: relaxed atomic loads (glc) at agent scope, 32 or 64 bits at a time.
__device__ __forceinline__ unsigned LoadCg(const unsigned* p) {
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ __forceinline__ unsigned long long LoadCg(const unsigned long long* p) {
  return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ __forceinline__ uint2 LoadCg(const uint2* p) {
  const auto* w = reinterpret_cast<const unsigned*>(p);
  return make_uint2(LoadCg(w), LoadCg(w + 1));
}
__device__ __forceinline__ uint4 LoadCg(const uint4* p) {
  const auto* w = reinterpret_cast<const unsigned*>(p);
  return make_uint4(LoadCg(w), LoadCg(w + 1), LoadCg(w + 2), LoadCg(w + 3));
}
/// s_sleep's argument is an immediate (units of 64 cycles): one unit, whatever `ns` asks.
__device__ __forceinline__ void SleepNs(unsigned /*ns*/) { __builtin_amdgcn_s_sleep(1); }

#endif  // LLEP_GPU_CUDA / LLEP_GPU_HIP
#endif  // a GPU compiler

}  // namespace llep::gpu
