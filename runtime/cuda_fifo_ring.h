// Allocation of a GPU→CPU command ring (runtime/protocol/fifo_ring.h) for CUDA producers: ring, tail and abort
// flag in pinned host memory mapped into the GPU (the consumer polls host memory, never PCIe), head and tail
// cache in device memory (the slot-claim atomic stays on the GPU). Layer: runtime; needs the CUDA runtime.
#pragma once

#include <cstdint>

#include "runtime/protocol/fifo_ring.h"
#include "runtime/protocol/gpu_api.h"

namespace llep {

class CudaFifoRing {
 public:
  CudaFifoRing() = default;
  CudaFifoRing(const CudaFifoRing&) = delete;
  CudaFifoRing& operator=(const CudaFifoRing&) = delete;

  protocol::FifoRingHandle device{};  ///< pointers valid on the GPU (producers)
  protocol::FifoRingHandle host{};    ///< pointers valid on the CPU (the consumer; head/tail_cache unused there)
  /// Allocates a zeroed ring of `size` (power of two) commands.
  cudaError_t Init(uint32_t size) {
    cudaError_t e;
    if ((e = cudaHostAlloc(&ring_, size * sizeof(protocol::FifoCmd), cudaHostAllocMapped)) != cudaSuccess) return e;
    if ((e = cudaHostAlloc(&host_words_, 2 * sizeof(uint64_t), cudaHostAllocMapped)) != cudaSuccess) return e;
    if ((e = cudaMalloc(&dev_words_, 2 * sizeof(uint64_t))) != cudaSuccess) return e;
    if ((e = cudaMemset(dev_words_, 0, 2 * sizeof(uint64_t))) != cudaSuccess) return e;
    __builtin_memset(ring_, 0, size * sizeof(protocol::FifoCmd));
    __builtin_memset(host_words_, 0, 2 * sizeof(uint64_t));
    protocol::FifoCmd* d_ring = nullptr;
    uint64_t* d_host_words = nullptr;
    if ((e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_ring), ring_, 0)) != cudaSuccess) return e;
    if ((e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_host_words), host_words_, 0)) != cudaSuccess)
      return e;
    // host_words_[0] = tail, host_words_[1] = abort flag (low 32 bits)
    device = {
        d_ring, dev_words_, d_host_words, dev_words_ + 1, reinterpret_cast<const volatile int32_t*>(d_host_words + 1),
        size};
    host = {ring_, nullptr, host_words_, nullptr, reinterpret_cast<const volatile int32_t*>(host_words_ + 1), size};
    return cudaSuccess;
  }
  /// The abort flag as the CPU sees it: non-zero makes producers stuck on a full ring return false instead of spinning.
  int32_t* abort_word() const { return reinterpret_cast<int32_t*>(host_words_ + 1); }
  void Abort() { __atomic_store_n(abort_word(), 1, __ATOMIC_RELEASE); }
  ~CudaFifoRing() {  // teardown: nothing to do about a failed free
    if (ring_) (void)cudaFreeHost(ring_);
    if (host_words_) (void)cudaFreeHost(host_words_);
    if (dev_words_) (void)cudaFree(dev_words_);
  }

 private:
  protocol::FifoCmd* ring_ = nullptr;
  uint64_t* host_words_ = nullptr;
  uint64_t* dev_words_ = nullptr;
};

}  // namespace llep
