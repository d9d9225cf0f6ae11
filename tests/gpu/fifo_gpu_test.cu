// The FIFO producer from CUDA warps: 132 blocks x 8 warps push concurrently into a 1024-entry ring in mapped
// host memory (wrapping hundreds of times) while a host thread consumes, one command per push (FifoPush) and
// warp-aggregated (FifoPushWarp, ragged lane masks). Nothing may be lost, duplicated or reordered within a warp
// (or a lane). Skips when no CUDA device is present.
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
    const uint64_t word = protocol::JoinHalves(warp, i);
    if (!protocol::FifoPush(ring, protocol::MakeSignalCmd(protocol::LlOp::kCombine, i & 1, warp & 0xFFFF, word))) {
      atomicAdd(failures, 1);
      return;
    }
  }
}

// Drains `total` commands from `ring` while the kernel (already launched) produces them, calling check(fields) on each
// in ring order; then waits for the kernel and expects no push failures and nothing extra. Fails (and aborts the ring
// so the kernel returns) if they do not all arrive within 60 s.
template <typename Check>
void DrainAndCheck(CudaFifoRing& ring, int64_t total, int* failures, Check check) {
  proxy::FifoConsumer consumer(ring.host);
  protocol::FifoCmd out[256];
  int64_t received = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (received < total) {
    const int got = consumer.Poll(out, 256);
    for (int i = 0; i < got; ++i) {
      protocol::FifoCmdFields f{};
      ASSERT_TRUE(protocol::DecodeCmd(out[i], &f));
      check(f);
      if (::testing::Test::HasFatalFailure()) {
        ring.Abort();
        return;
      }
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

  std::vector<int> next(kBlocks * kWarps, 0);
  DrainAndCheck(ring, int64_t{kBlocks} * kWarps * kPerWarp, failures, [&](const protocol::FifoCmdFields& f) {
    const int warp = static_cast<int>(protocol::HighHalf(f.signal_word)),
              seq = static_cast<int>(protocol::LowHalf(f.signal_word));
    ASSERT_LT(warp, kBlocks * kWarps);
    ASSERT_EQ(seq, next[warp]) << "warp " << warp;
    ASSERT_EQ(f.dst_rank, warp & 0xFFFF);
    ASSERT_EQ(f.half, seq & 1);
    ++next[warp];
  });
  (void)cudaFree(failures);
}

// Warp-aggregated pushes: in round i lane l pushes when (i + l) % 3 != 0 (ragged masks), 32 x 8 warps into a
// 512-entry ring. Every (warp, lane) stream must arrive complete and in order.
__global__ void PushWarpKernel(protocol::FifoRingHandle ring, int rounds, int* failures) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  int sent = 0;
  for (int i = 0; i < rounds; ++i) {
    const bool active = (i + lane) % 3 != 0;
    const uint64_t word = protocol::JoinHalves((warp << 8) | lane, sent);
    if (!protocol::FifoPushWarp(ring, protocol::MakeSignalCmd(protocol::LlOp::kDispatch, 0, lane, word), active)) {
      if (lane == 0) atomicAdd(failures, 1);
      return;
    }
    sent += active ? 1 : 0;
  }
}

TEST(FifoGpuTest, WarpAggregatedPushesKeepEveryLaneInOrder) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no CUDA device";
  CudaFifoRing ring;
  ASSERT_EQ(ring.Init(512), cudaSuccess);
  constexpr int kBlocks = 32, kWarps = 8, kRounds = 300;
  int* failures = nullptr;
  ASSERT_EQ(cudaMalloc(&failures, sizeof(int)), cudaSuccess);
  ASSERT_EQ(cudaMemset(failures, 0, sizeof(int)), cudaSuccess);
  PushWarpKernel<<<kBlocks, kWarps * 32>>>(ring.device, kRounds, failures);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  int per_lane_total[32] = {};
  for (int l = 0; l < 32; ++l) {
    for (int i = 0; i < kRounds; ++i) per_lane_total[l] += (i + l) % 3 != 0 ? 1 : 0;
  }
  int64_t total = 0;
  for (int l = 0; l < 32; ++l) total += int64_t{kBlocks} * kWarps * per_lane_total[l];
  std::vector<int> next(kBlocks * kWarps * 32, 0);
  DrainAndCheck(ring, total, failures, [&](const protocol::FifoCmdFields& f) {
    const int warp = static_cast<int>(protocol::HighHalf(f.signal_word) >> 8),
              lane = static_cast<int>(protocol::HighHalf(f.signal_word) & 0xFF);
    ASSERT_LT(warp, kBlocks * kWarps);
    ASSERT_EQ(f.dst_rank, lane);
    ASSERT_EQ(static_cast<int>(protocol::LowHalf(f.signal_word)), next[warp * 32 + lane]) << "warp " << warp;
    ++next[warp * 32 + lane];
  });
  (void)cudaFree(failures);
}

}  // namespace
}  // namespace llep
