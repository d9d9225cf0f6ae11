// Micro-benchmarks (google-benchmark) of the CPU backend's hot loops: FP8 payload encoding, route planning and
// the FIFO push/pop round trip. They size what the CPU backend costs per token, not network latency.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "kernels/codec/fp8.h"
#include "kernels/host/ll_host.h"
#include "kernels/host/route_plan.h"
#include "proxy/fifo_consumer.h"
#include "runtime/protocol/fifo_ring.h"

namespace llep {
namespace {

void BM_EncodeFp8Token(benchmark::State& state) {
  const int H = static_cast<int>(state.range(0));
  std::vector<uint16_t> x(H);
  std::mt19937 rng(1);
  for (auto& v : x) v = kernels::FloatToBf16(std::uniform_real_distribution<float>(-3, 3)(rng));
  std::vector<uint8_t> payload(protocol::DispatchPayloadStrideMax(H));
  const protocol::DispatchMode mode{true, false, false};
  for (auto _ : state) {
    kernels::EncodeDispatchPayload(x.data(), H, mode, payload.data());
    benchmark::DoNotOptimize(payload.data());
  }
  state.SetBytesProcessed(state.iterations() * H * 2);
}
BENCHMARK(BM_EncodeFp8Token)->Arg(2048)->Arg(7168);

void BM_CombineAccumulateRow(benchmark::State& state) {
  const int H = static_cast<int>(state.range(0));
  std::vector<uint16_t> row(H);
  std::vector<float> acc(H, 0.0f);
  std::mt19937 rng(3);
  for (auto& v : row) v = kernels::FloatToBf16(std::uniform_real_distribution<float>(-3, 3)(rng));
  for (auto _ : state) {
    kernels::AccumulateWeightedRow(acc.data(), row.data(), 0.37f, H);
    benchmark::DoNotOptimize(acc.data());
  }
  state.SetItemsProcessed(state.iterations() * H);
}
BENCHMARK(BM_CombineAccumulateRow)->Arg(7168);

void BM_RoutePlan(benchmark::State& state) {
  const protocol::LlShape shape{128, 7168, 256, static_cast<int>(state.range(0))};
  std::vector<int64_t> topk(128 * 8);
  std::mt19937 rng(2);
  for (int t = 0; t < 128; ++t) {
    std::vector<int64_t> perm(256);
    for (int e = 0; e < 256; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int k = 0; k < 8; ++k) topk[t * 8 + k] = perm[k];
  }
  kernels::RoutePlan plan;
  for (auto _ : state) {
    kernels::BuildRoutePlan(shape, topk.data(), 128, 8, &plan);
    benchmark::DoNotOptimize(plan.entries.data());
  }
}
BENCHMARK(BM_RoutePlan)->Arg(4)->Arg(16);

void BM_FifoPushPop(benchmark::State& state) {
  std::vector<protocol::FifoCmd> ring(4096);
  uint64_t head = 0, tail = 0, tail_cache = 0;
  volatile int32_t abort_flag = 0;
  const protocol::FifoRingHandle h{ring.data(), &head, &tail, &tail_cache, &abort_flag, 4096};
  proxy::FifoConsumer consumer(h);
  protocol::FifoCmd out[64];
  const protocol::FifoCmd cmd = protocol::MakeWriteCmd(protocol::LlOp::kDispatch, 0, 1, 0, 0, 7392);
  for (auto _ : state) {
    for (int i = 0; i < 64; ++i) protocol::FifoPush(h, cmd);
    benchmark::DoNotOptimize(consumer.Poll(out, 64));
  }
  state.SetItemsProcessed(state.iterations() * 64);
}
BENCHMARK(BM_FifoPushPop);

}  // namespace
}  // namespace llep

BENCHMARK_MAIN();
