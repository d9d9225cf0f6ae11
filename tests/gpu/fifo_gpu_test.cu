// The FIFO producer from CUDA warps: 132 blocks x 8 warps push concurrently into a 1024-entry ring in mapped
// host memory (wrapping hundreds of times) while a host thread consumes. Nothing may be lost, duplicated or
// reordered within a warp. Skips when no CUDA device is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <vector>

#include "proxy/fifo_consumer.h"
#include "runtime/cuda_fifo_ring.h"

namespace llep {
namespace {

__global__ void PushKernel(protocol::FifoRingHandle ring, int per_warp, int* failures) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  if (threadIdx.x % 32 != 0) return;
  for (int i = 0; i < per_warp; ++i) {
    const uint64_t word = (static_cast<uint64_t>(warp) << 32) | static_cast<uint32_t>(i);
    if (!protocol::FifoPush(ring, protocol::MakeSignalCmd(protocol::LlOp::kCombine, i & 1, warp & 0xFFFF, word))) {
      atomicAdd(failures, 1);
      return;
    }
  }
}

TEST(FifoGpuTest, WarpsPushHostConsumesEverythingInOrder) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no CUDA device";
  CudaFifoRing ring;
  ASSERT_EQ(ring.Init(1024), cudaSuccess);
  constexpr int kBlocks = 132, kWarps = 8, kPerWarp = 500;
  int* failures = nullptr;
  ASSERT_EQ(cudaMalloc(&failures, sizeof(int)), cudaSuccess);
  ASSERT_EQ(cudaMemset(failures, 0, sizeof(int)), cudaSuccess);
  PushKernel<<<kBlocks, kWarps * 32>>>(ring.device, kPerWarp, failures);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);

  proxy::FifoConsumer consumer(ring.host);
  std::vector<int> next(kBlocks * kWarps, 0);
  protocol::FifoCmd out[256];
  const int total = kBlocks * kWarps * kPerWarp;
  int received = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (received < total) {
    const int got = consumer.Poll(out, 256);
    for (int i = 0; i < got; ++i) {
      protocol::FifoCmdFields f{};
      ASSERT_TRUE(protocol::DecodeCmd(out[i], &f));
      const int warp = static_cast<int>(f.signal_word >> 32), seq = static_cast<int>(f.signal_word & 0xFFFFFFFF);
      ASSERT_LT(warp, kBlocks * kWarps);
      ASSERT_EQ(seq, next[warp]) << "warp " << warp;
      ASSERT_EQ(f.dst_rank, warp & 0xFFFF);
      ASSERT_EQ(f.half, seq & 1);
      ++next[warp];
    }
    received += got;
    if (std::chrono::steady_clock::now() > deadline) {
      ring.Abort();  // let the kernel return instead of hanging the device
      FAIL() << "only " << received << " of " << total << " commands arrived";
    }
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  int h_failures = -1;
  ASSERT_EQ(cudaMemcpy(&h_failures, failures, sizeof(int), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(h_failures, 0);
  EXPECT_EQ(consumer.Poll(out, 256), 0);
  cudaFree(failures);
}

}  // namespace
}  // namespace llep
