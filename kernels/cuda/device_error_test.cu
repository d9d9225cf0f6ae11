// The kernels' error records (protocol::DeviceErrorRecords) on the device: the first error of each severity keeps
// its record, so a fatal error that follows an unread recoverable one is still reported (before, it was dropped and
// the buffer was aborted on the device while the host saw only the bad input: the GPU bad-input catalogue's silent
// dead buffer). Calls RecordErrorOutOfLine, the body every RecordError site runs, from one GPU thread. Skips when no
// GPU is present.
#include <gtest/gtest.h>

#include <vector>

#include "kernels/cuda/gpu_test_support.h"
#include "kernels/cuda/ll_device_common.cuh"
#include "runtime/protocol/device_error.h"
#include "runtime/protocol/gpu_api.h"

namespace llep::kernels::cuda {
namespace {

struct Recorded {
  uint32_t code;
  int64_t detail;
};

/// Records `n` errors in order, each with a call number (not kSeqPending) and peer 7.
__global__ void RecordInOrder(uint32_t* flags, protocol::DeviceErrorRecords* errors, unsigned long long* timeouts,
                              const Recorded* list, int n) {
  for (int i = 0; i < n; ++i) RecordErrorOutOfLine(flags, errors, timeouts, list[i].code, 0, 7, 40 + i, list[i].detail);
}

class DeviceErrorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveDevice()) GTEST_SKIP() << "no GPU";
    void* p = nullptr;
    ASSERT_CUDA(cudaMalloc(&p, 2 * sizeof(uint32_t) + sizeof(unsigned long long)));
    word_area_ = static_cast<uint8_t*>(p);
    ASSERT_CUDA(cudaMemset(word_area_, 0, 2 * sizeof(uint32_t) + sizeof(unsigned long long)));
    ASSERT_CUDA(cudaHostAlloc(&p, sizeof(protocol::DeviceErrorRecords), cudaHostAllocMapped));
    errors_ = static_cast<protocol::DeviceErrorRecords*>(p);
    *errors_ = {};
    ASSERT_CUDA(cudaHostGetDevicePointer(&p, errors_, 0));
    d_errors_ = static_cast<protocol::DeviceErrorRecords*>(p);
    ASSERT_CUDA(cudaMalloc(&p, 8 * sizeof(Recorded)));
    list_ = static_cast<Recorded*>(p);
  }
  void TearDown() override {
    if (word_area_ != nullptr) (void)cudaFree(word_area_);
    if (errors_ != nullptr) (void)cudaFreeHost(errors_);
    if (list_ != nullptr) (void)cudaFree(list_);
  }

  /// Records `list` on the GPU, then reads flags_ and timeouts_ back.
  void Run(const std::vector<Recorded>& list) {
    ASSERT_CUDA(cudaMemcpy(list_, list.data(), list.size() * sizeof(Recorded), cudaMemcpyHostToDevice));
    auto* d_flags = reinterpret_cast<uint32_t*>(word_area_);
    auto* d_timeouts = reinterpret_cast<unsigned long long*>(word_area_ + 2 * sizeof(uint32_t));
    RecordInOrder<<<1, 1>>>(d_flags, d_errors_, d_timeouts, list_, static_cast<int>(list.size()));
    ASSERT_CUDA(cudaGetLastError());
    ASSERT_CUDA(cudaDeviceSynchronize());
    ASSERT_CUDA(cudaMemcpy(flags_, d_flags, sizeof(flags_), cudaMemcpyDeviceToHost));
    ASSERT_CUDA(cudaMemcpy(&timeouts_, d_timeouts, sizeof(timeouts_), cudaMemcpyDeviceToHost));
  }

  uint32_t flags_[2] = {};           // [0] recoverable record claimed, [1] aborted (fatal record claimed)
  unsigned long long timeouts_ = 0;  // the metrics word counting timeouts
  uint8_t* word_area_ = nullptr;     // flags[2], then the timeout counter
  protocol::DeviceErrorRecords* errors_ = nullptr;
  protocol::DeviceErrorRecords* d_errors_ = nullptr;
  Recorded* list_ = nullptr;
};

TEST_F(DeviceErrorTest, FatalAfterRecoverableKeepsBothFirsts) {
  Run({{protocol::kDeviceBadExpertId, -2},
       {protocol::kDeviceCombineMismatch, 5},
       {protocol::kDeviceTimeout, 1},
       {protocol::kDeviceBadMessage, 3},
       {protocol::kDeviceTimeout, 2}});
  EXPECT_EQ(flags_[0], 1u);
  EXPECT_EQ(flags_[1], 1u);  // aborted
  EXPECT_EQ(errors_->recoverable.code, protocol::kDeviceBadExpertId);
  EXPECT_EQ(errors_->recoverable.detail, -2);
  EXPECT_EQ(errors_->recoverable.seq, 40u);
  EXPECT_EQ(errors_->recoverable.peer, 7);
  EXPECT_EQ(errors_->fatal.code, protocol::kDeviceTimeout);
  EXPECT_EQ(errors_->fatal.detail, 1);
  EXPECT_EQ(errors_->fatal.seq, 42u);
  EXPECT_EQ(timeouts_, 1u);  // the thread that aborted counts its timeout; later timeouts are the same abort
}

TEST_F(DeviceErrorTest, RecoverableAloneDoesNotAbort) {
  Run({{protocol::kDeviceBadLayoutRange, 9}, {protocol::kDeviceBadExpertId, 8}});
  EXPECT_EQ(flags_[0], 1u);
  EXPECT_EQ(flags_[1], 0u);
  EXPECT_EQ(errors_->recoverable.code, protocol::kDeviceBadLayoutRange);
  EXPECT_EQ(errors_->recoverable.detail, 9);
  EXPECT_EQ(errors_->fatal.code, protocol::kDeviceOk);
  EXPECT_EQ(timeouts_, 0u);
}

TEST_F(DeviceErrorTest, FatalAloneLeavesTheRecoverableRecordFree) {
  Run({{protocol::kDeviceInFlight, 77}});
  EXPECT_EQ(flags_[0], 0u);
  EXPECT_EQ(flags_[1], 1u);
  EXPECT_EQ(errors_->fatal.code, protocol::kDeviceInFlight);
  EXPECT_EQ(errors_->fatal.detail, 77);
  EXPECT_EQ(errors_->recoverable.code, protocol::kDeviceOk);
  EXPECT_EQ(timeouts_, 0u);
}

}  // namespace
}  // namespace llep::kernels::cuda
