// ScanMessages / LocateMessage (ll_routing.cuh) on the device against the plain expansion: every message of every
// source, in source order, for source counts with masked (-1) and empty sources, at R <= 32 (the kept scan alone)
// and above 32 (the loop over later chunks), as the dispatch receive's items and the expert-side combine's send use
// them. The GPU-vs-CPU matrix runs R = 2 and 4 only, so the path beyond 32 sources is tested here. Skips when no GPU
// is present.
#include <gtest/gtest.h>

#include <random>
#include <utility>
#include <vector>

#include "kernels/cuda/gpu_test_support.h"
#include "kernels/cuda/ll_routing.cuh"
#include "runtime/protocol/gpu_api.h"

namespace llep::kernels::cuda {
namespace {

/// One warp: total[0] = the scan's total, then each message m < max_m (or the total, the smaller) located into
/// out[m] = {src, j}.
__global__ void LocateAll(const int* counts, int R, int max_m, int* total, int2* out) {
  const auto count = [&](int src) { return counts[src]; };
  const MessageScan sc = ScanMessages(count, R);
  if (threadIdx.x == 0) *total = sc.total;
  const int n = sc.total < max_m ? sc.total : max_m;
  for (int m = 0; m < n; ++m) {
    const MessageRef ref = LocateMessage(count, R, m, sc);
    if (threadIdx.x == 0) out[m] = make_int2(ref.src, ref.j);
  }
}

class MessageScanTest : public ::testing::Test {
 protected:
  static constexpr int kMaxSources = 128, kMaxMessages = kMaxSources * 6;
  void SetUp() override {
    if (!HaveDevice()) GTEST_SKIP() << "no GPU";
    ASSERT_CUDA(cudaMalloc(&counts_, kMaxSources * sizeof(int)));
    ASSERT_CUDA(cudaMalloc(&total_, sizeof(int)));
    ASSERT_CUDA(cudaMalloc(&out_, kMaxMessages * sizeof(int2)));
  }
  void TearDown() override {
    if (counts_ != nullptr) (void)cudaFree(counts_);
    if (total_ != nullptr) (void)cudaFree(total_);
    if (out_ != nullptr) (void)cudaFree(out_);
  }

  /// Runs LocateAll on `counts` and checks the total and every message against the expansion.
  void Check(const std::vector<int>& counts) {
    const int R = static_cast<int>(counts.size());
    std::vector<std::pair<int, int>> want;  // message m -> (source, index among that source's)
    for (int s = 0; s < R; ++s) {
      for (int j = 0; j < counts[s]; ++j) want.emplace_back(s, j);  // a masked source (-1) has none
    }
    ASSERT_LE(want.size(), static_cast<size_t>(kMaxMessages));
    ASSERT_CUDA(cudaMemcpy(counts_, counts.data(), R * sizeof(int), cudaMemcpyHostToDevice));
    ASSERT_CUDA(cudaMemset(out_, 0xFF, kMaxMessages * sizeof(int2)));
    LocateAll<<<1, 32>>>(counts_, R, kMaxMessages, total_, out_);
    ASSERT_CUDA(cudaGetLastError());
    ASSERT_CUDA(cudaDeviceSynchronize());
    int total = -1;
    std::vector<int2> got(want.size());
    ASSERT_CUDA(cudaMemcpy(&total, total_, sizeof(int), cudaMemcpyDeviceToHost));
    ASSERT_CUDA(cudaMemcpy(got.data(), out_, got.size() * sizeof(int2), cudaMemcpyDeviceToHost));
    ASSERT_EQ(total, static_cast<int>(want.size())) << "R = " << R;
    for (size_t m = 0; m < want.size(); ++m) {
      ASSERT_EQ(got[m].x, want[m].first) << "R = " << R << ", message " << m;
      ASSERT_EQ(got[m].y, want[m].second) << "R = " << R << ", message " << m;
    }
  }

  int* counts_ = nullptr;
  int* total_ = nullptr;
  int2* out_ = nullptr;
};

TEST_F(MessageScanTest, EveryMessageAtAndBeyond32Sources) {
  std::mt19937 rng(52);
  std::uniform_int_distribution<int> count(-1, 5);  // -1: a masked source, 0: one that sent nothing
  for (int R : {1, 2, 3, 4, 8, 31, 32, 33, 63, 64, 65, 100, kMaxSources}) {
    std::vector<int> counts(R);
    for (int& c : counts) c = count(rng);
    Check(counts);
  }
}

TEST_F(MessageScanTest, EdgeCounts) {
  Check({0});
  Check({-1, -1, -1});
  Check({0, 0, 7});
  Check(std::vector<int>(40, 0));  // no messages at all beyond 32 sources
  std::vector<int> late(70, 0);
  late[69] = 3;  // every message in the third chunk
  Check(late);
  std::vector<int> edge(33, 1);
  edge[32] = 4;  // the first message beyond the kept scan is source 32's first
  Check(edge);
}

}  // namespace
}  // namespace llep::kernels::cuda
