// Real libfabric endpoints in one process on loopback: RMA writes with remote CQ data land, completions carry
// the cookie and the immediate, the queue-full path is exercised, and bad calls are rejected. shm and
// tcp;ofi_rxm are required on every CI host (scripts/install_deps.sh installs libfabric).
#include "proxy/fabric/fabric_transport.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

namespace llep::proxy {
namespace {

class FabricTransportTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    for (int r = 0; r < 2; ++r) {
      auto t = CreateFabricTransport({GetParam(), "127.0.0.1"});
      ASSERT_TRUE(t.ok()) << t.status();
      regions_[r].reset(new uint8_t[kBytes]());
      ASSERT_TRUE((*t)->RegisterRegion(regions_[r].get(), kBytes).ok());
      t_[r] = *std::move(t);
    }
    std::vector<std::string> blobs;
    for (int r = 0; r < 2; ++r) blobs.push_back(*t_[r]->LocalBlob());
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(t_[r]->Connect(blobs).ok());
  }

  // Polls both sides until `rx` immediates reached rank 1 and `tx` writes completed on rank 0.
  void Drain(int tx, int rx, std::vector<uint32_t>* imms, std::vector<uint64_t>* cookies) {
    Completion c[16];
    for (long spins = 0; (static_cast<int>(imms->size()) < rx || static_cast<int>(cookies->size()) < tx); ++spins) {
      ASSERT_LT(spins, 20000000) << "completions missing";
      for (int r = 0; r < 2; ++r) {
        auto n = t_[r]->Poll(c, 16);
        ASSERT_TRUE(n.ok()) << n.status();
        for (int i = 0; i < *n; ++i) {
          if (c[i].kind == Completion::Kind::kRemoteImm) {
            EXPECT_EQ(r, 1);
            imms->push_back(c[i].imm);
          } else {
            EXPECT_EQ(r, 0);
            cookies->push_back(c[i].cookie);
          }
        }
      }
    }
  }

  // Posts, progressing both endpoints while the send queue is busy (connection setup answers EAGAIN first).
  void PostRetry(uint64_t lo, uint64_t ro, uint64_t bytes, uint32_t imm, uint64_t cookie, std::vector<uint32_t>* imms,
                 std::vector<uint64_t>* cookies) {
    Completion c[16];
    for (long spins = 0;; ++spins) {
      ASSERT_LT(spins, 20000000) << "send queue never drained";
      auto posted = t_[0]->PostWrite(1, lo, ro, bytes, imm, cookie);
      ASSERT_TRUE(posted.ok()) << posted.status();
      if (*posted) return;
      for (int r = 0; r < 2; ++r) {
        auto n = t_[r]->Poll(c, 16);
        ASSERT_TRUE(n.ok()) << n.status();
        for (int i = 0; i < *n; ++i) {
          if (c[i].kind == Completion::Kind::kRemoteImm)
            imms->push_back(c[i].imm);
          else
            cookies->push_back(c[i].cookie);
        }
      }
    }
  }

  static constexpr uint64_t kBytes = 1 << 22;
  std::unique_ptr<uint8_t[]> regions_[2];
  std::unique_ptr<Transport> t_[2];
};

TEST_P(FabricTransportTest, WriteWithImmediateLandsBeforeItsCompletion) {
  for (uint64_t i = 0; i < 4096; ++i) regions_[0][64 + i] = static_cast<uint8_t>(i * 7 + 1);
  std::vector<uint32_t> imms;
  std::vector<uint64_t> cookies;
  PostRetry(64, 8192, 4096, 0xA5A5u, 77, &imms, &cookies);
  Drain(1, 1, &imms, &cookies);
  EXPECT_EQ(imms[0], 0xA5A5u);
  EXPECT_EQ(cookies[0], 77u);
  EXPECT_EQ(std::memcmp(regions_[1].get() + 8192, regions_[0].get() + 64, 4096), 0);
}

TEST_P(FabricTransportTest, ManyWritesAllComplete) {
  constexpr int kWrites = 2000;
  std::vector<uint32_t> imms;
  std::vector<uint64_t> cookies;
  for (int i = 0; i < kWrites; ++i) {
    PostRetry(0, (i % 64) * 8192, 16 + 16 * (i % 300), static_cast<uint32_t>(i), i, &imms, &cookies);
  }
  Drain(kWrites, kWrites, &imms, &cookies);
  std::vector<bool> seen(kWrites, false);
  for (uint32_t imm : imms) seen.at(imm) = true;
  for (int i = 0; i < kWrites; ++i) EXPECT_TRUE(seen[i]) << "immediate " << i << " lost";
}

TEST_P(FabricTransportTest, RejectsBadCalls) {
  EXPECT_EQ(t_[0]->PostWrite(5, 0, 0, 16, 1, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t_[0]->PostWrite(1, kBytes - 8, 0, 16, 1, 0).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(t_[0]->RegisterRegion(regions_[0].get(), 64).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(t_[0]->Connect({"short"}).code(), absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Providers, FabricTransportTest, ::testing::Values("shm", "tcp;ofi_rxm"), [](const auto& info) {
  return info.param == "shm" ? std::string("shm") : std::string("tcp_rxm");
});

TEST(FabricProvidersTest, UnknownProviderIsAClearError) {
  auto t = CreateFabricTransport({"no-such-provider", "127.0.0.1"});
  ASSERT_FALSE(t.ok());
  EXPECT_NE(std::string(t.status().message()).find("no-such-provider"), std::string::npos);
  const std::vector<std::string> providers = ListFabricProviders();
  EXPECT_NE(std::find(providers.begin(), providers.end(), "shm"), providers.end());
}

}  // namespace
}  // namespace llep::proxy
