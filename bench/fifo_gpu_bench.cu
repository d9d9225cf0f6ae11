// GPU→CPU FIFO throughput and latency on one GPU: W warps push commands as fast as they can into one ring in
// mapped host memory while one host thread consumes (the proxy's pop path, no network); and a ping-pong where
// one warp pushes, the host pops and acknowledges through mapped memory, giving push-to-pop latency as half the
// round trip. Prints a table; run on the GPU machine.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

#include "bench/check_cuda.h"
#include "proxy/fifo_consumer.h"
#include "runtime/cuda_fifo_ring.h"
#include "runtime/protocol/gpu_api.h"
#include "runtime/protocol/gpu_port.h"

namespace llep {
namespace {

__global__ void FloodKernel(protocol::FifoRingHandle ring, int per_warp) {
  if (threadIdx.x % 32 != 0) return;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  for (int i = 0; i < per_warp; ++i) {
    if (!protocol::FifoPush(ring, protocol::MakeWriteCmd(protocol::LlOp::kDispatch, 0, warp & 0xFFFF, 0, 16 * i, 7392)))
      return;
  }
}

// Several rings (the proxy's layout: one ring and one consumer thread per proxy thread): CTA b pushes into ring
// b % num_rings, so a ring's producers are whole SMs.
// per_warp counts commands per warp: with `batched`, lanes push 32 at a time (FifoPushWarp), else lane 0 alone.
__global__ void FloodRingsKernel(const protocol::FifoRingHandle* rings, int num_rings, int per_warp, bool batched) {
  const protocol::FifoRingHandle ring = rings[blockIdx.x % num_rings];
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (batched) {
    for (int i = 0; i < per_warp; i += 32) {
      const auto cmd = protocol::MakeWriteCmd(protocol::LlOp::kDispatch, 0, warp & 0xFFFF, 0, 16 * (i + lane), 7392);
      if (!protocol::FifoPushWarp(ring, cmd, true)) return;
    }
    return;
  }
  if (lane != 0) return;
  for (int i = 0; i < per_warp; ++i) {
    if (!protocol::FifoPush(ring, protocol::MakeWriteCmd(protocol::LlOp::kDispatch, 0, warp & 0xFFFF, 0, 16 * i, 7392)))
      return;
  }
}

__device__ uint64_t GlobalTimer() { return llep::gpu::GlobalTimerNs(); }

__global__ void PingKernel(protocol::FifoRingHandle ring, const volatile uint64_t* ack, int rounds, uint64_t* ns) {
  if (threadIdx.x != 0) return;  // one producer: every round is exactly one command and one ack
  for (int i = 1; i <= rounds; ++i) {
    const uint64_t t0 = GlobalTimer();
    if (!protocol::FifoPush(ring, protocol::MakeSignalCmd(protocol::LlOp::kDispatch, 0, 1, i))) return;
    // The abort flag is host memory too: read it rarely, so each poll is one PCIe read, not two.
    for (uint32_t spin = 1; *ack != static_cast<uint64_t>(i); ++spin) {
      if ((spin & 1023u) == 0 && *ring.abort_flag != 0) return;
    }
    ns[i - 1] = GlobalTimer() - t0;
  }
}

int Main() {
  std::printf("%-28s %14s %14s\n", "producers (blocks x warps)", "M commands/s", "commands");
  for (const auto& [blocks, warps] : std::vector<std::pair<int, int>>{{1, 1}, {8, 4}, {32, 8}, {132, 8}, {132, 16}}) {
    CudaFifoRing ring;
    LLEP_BENCH_CHECK_CUDA(ring.Init(8192));
    const int per_warp = std::max(2000, 4000000 / (blocks * warps));
    const int64_t total = int64_t{blocks} * warps * per_warp;
    proxy::FifoConsumer consumer(ring.host);
    protocol::FifoCmd out[512];
    const auto t0 = std::chrono::steady_clock::now();
    FloodKernel<<<blocks, warps * 32>>>(ring.device, per_warp);
    LLEP_BENCH_CHECK_CUDA(cudaGetLastError());
    int64_t got = 0;
    const auto deadline = t0 + std::chrono::seconds(20);
    while (got < total && std::chrono::steady_clock::now() < deadline) {
      for (int k = 0; k < 1024 && got < total; ++k) got += consumer.Poll(out, 512);
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (got < total) {
      ring.Abort();  // producers stuck on a full ring return; report instead of hanging
      while (cudaStreamQuery(nullptr) == cudaErrorNotReady) consumer.Poll(out, 512);
      std::printf("%4d x %-23d timed out: %lld of %lld commands in %.1f s\n", blocks, warps,
                  static_cast<long long>(got), static_cast<long long>(total), secs);
      continue;
    }
    LLEP_BENCH_CHECK_CUDA(cudaDeviceSynchronize());
    std::printf("%4d x %-23d %14.1f %14lld\n", blocks, warps, total / secs / 1e6, static_cast<long long>(total));
  }

  // Several rings, one consumer thread each, all SMs producing.
  std::printf("\n%-8s %-6s %-26s %14s %14s\n", "push", "rings", "producers (blocks x warps)", "M commands/s",
              "commands");
  for (const bool batched : {false, true}) {
    for (const int num_rings : {1, 2, 4, 8}) {
      for (const auto& [blocks, warps] : std::vector<std::pair<int, int>>{{132, 1}, {132, 4}, {132, 8}}) {
        std::vector<std::unique_ptr<CudaFifoRing>> rings;
        std::vector<protocol::FifoRingHandle> handles;
        for (int r = 0; r < num_rings; ++r) {
          rings.push_back(std::make_unique<CudaFifoRing>());
          LLEP_BENCH_CHECK_CUDA(rings.back()->Init(8192));
          handles.push_back(rings.back()->device);
        }
        protocol::FifoRingHandle* d_handles = nullptr;
        LLEP_BENCH_CHECK_CUDA(cudaMalloc(&d_handles, sizeof(protocol::FifoRingHandle) * num_rings));
        LLEP_BENCH_CHECK_CUDA(cudaMemcpy(d_handles, handles.data(), sizeof(protocol::FifoRingHandle) * num_rings,
                                         cudaMemcpyHostToDevice));
        const int per_warp = (std::max(2000, (batched ? 32000000 : 8000000) / (blocks * warps)) + 31) / 32 * 32;
        std::vector<int64_t> expected(num_rings, 0);
        for (int b = 0; b < blocks; ++b) expected[b % num_rings] += int64_t{warps} * per_warp;
        std::atomic<int64_t> total_got{0};
        std::atomic<bool> stop{false};
        const auto t0 = std::chrono::steady_clock::now();
        std::vector<std::thread> consumers;
        for (int r = 0; r < num_rings; ++r) {
          consumers.emplace_back([&, r] {
            proxy::FifoConsumer consumer(rings[r]->host);
            protocol::FifoCmd out[512];
            int64_t got = 0;
            while (got < expected[r] && !stop.load(std::memory_order_relaxed)) got += consumer.Poll(out, 512);
            total_got += got;
          });
        }
        FloodRingsKernel<<<blocks, warps * 32>>>(d_handles, num_rings, per_warp, batched);
        LLEP_BENCH_CHECK_CUDA(cudaGetLastError());
        const auto deadline = t0 + std::chrono::seconds(20);
        while (cudaStreamQuery(nullptr) == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
        const bool timed_out = cudaStreamQuery(nullptr) == cudaErrorNotReady;
        if (timed_out) {
          for (auto& ring : rings) ring->Abort();
        }
        for (auto& t : consumers) {
          if (timed_out) stop = true;
          t.join();
        }
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        LLEP_BENCH_CHECK_CUDA(cudaDeviceSynchronize());
        (void)cudaFree(d_handles);
        const int64_t total = int64_t{blocks} * warps * per_warp;
        if (timed_out || total_got.load() != total) {
          std::printf("%-8s %-6d %4d x %-19d timed out: %lld of %lld\n", batched ? "warp" : "lane0", num_rings, blocks,
                      warps, static_cast<long long>(total_got.load()), static_cast<long long>(total));
          continue;
        }
        std::printf("%-8s %-6d %4d x %-19d %14.1f %14lld\n", batched ? "warp" : "lane0", num_rings, blocks, warps,
                    total / secs / 1e6, static_cast<long long>(total));
      }
    }
  }

  CudaFifoRing ring;
  LLEP_BENCH_CHECK_CUDA(ring.Init(1024));
  uint64_t* ack = nullptr;
  uint64_t* d_ack = nullptr;
  LLEP_BENCH_CHECK_CUDA(cudaHostAlloc(&ack, sizeof(uint64_t), cudaHostAllocMapped));
  *ack = 0;
  LLEP_BENCH_CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_ack), ack, 0));
  constexpr int kRounds = 20000;
  uint64_t* d_ns = nullptr;
  LLEP_BENCH_CHECK_CUDA(cudaMalloc(&d_ns, kRounds * sizeof(uint64_t)));
  proxy::FifoConsumer consumer(ring.host);
  PingKernel<<<1, 32>>>(ring.device, d_ack, kRounds, d_ns);
  LLEP_BENCH_CHECK_CUDA(cudaGetLastError());
  protocol::FifoCmd cmd;
  const auto ping_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  int rounds_done = 0;
  for (uint64_t polls = 1; rounds_done < kRounds; ++polls) {
    if (consumer.Poll(&cmd, 1) == 1) {
      __atomic_store_n(ack, cmd.w0, __ATOMIC_RELEASE);
      ++rounds_done;
    } else if ((polls & 0xFFFF) == 0 && std::chrono::steady_clock::now() > ping_deadline) {
      ring.Abort();
      std::printf("ping-pong timed out after %d rounds\n", rounds_done);
      return 1;
    }
  }
  LLEP_BENCH_CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint64_t> ns(kRounds);
  LLEP_BENCH_CHECK_CUDA(cudaMemcpy(ns.data(), d_ns, kRounds * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  std::sort(ns.begin() + 100, ns.end());  // first 100 rounds are warm-up
  const size_t n = ns.size() - 100;
  auto q = [&](double f) { return ns[100 + static_cast<size_t>(f * (n - 1))] / 1000.0; };
  std::printf(
      "\nping-pong GPU push -> host pop -> GPU sees ack (%d rounds): round trip median %.2f us, p99 %.2f us;"
      " push-to-pop <= %.2f us median\n",
      kRounds, q(0.5), q(0.99), q(0.5) / 2);
  (void)cudaFree(d_ns);
  (void)cudaFreeHost(ack);
  return 0;
}

}  // namespace
}  // namespace llep

int main() {
  std::setvbuf(stdout, nullptr, _IONBF, 0);  // partial results survive a kill
  return llep::Main();
}
