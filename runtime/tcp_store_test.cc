#include "runtime/tcp_store.h"

#include <gtest/gtest.h>

#include <thread>

#include "runtime/bootstrap.h"

namespace llep {
namespace {

TEST(TcpStoreTest, SetGetAndBlockingGet) {
  auto server = TcpStoreServer::Listen("127.0.0.1", 0);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->Start().ok());
  auto a = TcpStoreClient::Connect("127.0.0.1", (*server)->port(), absl::Seconds(5));
  auto b = TcpStoreClient::Connect("127.0.0.1", (*server)->port(), absl::Seconds(5));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->Set("k", std::string("v\0w", 3)).ok());
  auto v = (*b)->Get("k", absl::Seconds(5));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, std::string("v\0w", 3));
  // A get parks until another client sets the key.
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_TRUE((*a)->Set("late", std::string(100000, 'x')).ok());
  });
  auto late = (*b)->Get("late", absl::Seconds(5));
  setter.join();
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_EQ(late->size(), 100000u);
}

TEST(TcpStoreTest, GetTimesOutAndConnectFailsCleanly) {
  auto server = TcpStoreServer::Listen("127.0.0.1", 0);
  ASSERT_TRUE(server.ok());
  ASSERT_TRUE((*server)->Start().ok());
  auto c = TcpStoreClient::Connect("127.0.0.1", (*server)->port(), absl::Seconds(5));
  ASSERT_TRUE(c.ok());
  auto v = (*c)->Get("never", absl::Milliseconds(100));
  EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ((*c)->Set("x", "y").code(), absl::StatusCode::kFailedPrecondition);  // connection poisoned
  const int port = (*server)->port();
  server->reset();  // server gone: connecting fails with a clear error, no hang
  auto gone = TcpStoreClient::Connect("127.0.0.1", port, absl::Milliseconds(200));
  EXPECT_FALSE(gone.ok());
  EXPECT_FALSE(TcpStoreServer::Listen("not-an-ip", 0).ok());
}

TEST(BootstrapTest, StoreAllGatherAcrossThreads) {
  auto server = TcpStoreServer::Listen("127.0.0.1", 0);
  ASSERT_TRUE(server.ok());
  ASSERT_TRUE((*server)->Start().ok());
  constexpr int kRanks = 3;
  std::vector<std::thread> threads;
  std::vector<std::vector<std::string>> results(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      auto client = TcpStoreClient::Connect("127.0.0.1", (*server)->port(), absl::Seconds(5));
      ASSERT_TRUE(client.ok());
      auto boot = MakeStoreBootstrap(r, kRanks, *std::move(client), "t", absl::Seconds(10));
      for (int round = 0; round < 3; ++round) {
        auto all = boot->AllGather("rank" + std::to_string(r) + "/" + std::to_string(round));
        ASSERT_TRUE(all.ok()) << all.status();
        results[r] = *all;
      }
      ASSERT_TRUE(boot->Barrier().ok());
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(results[r].size(), 3u);
    for (int i = 0; i < kRanks; ++i) EXPECT_EQ(results[r][i], "rank" + std::to_string(i) + "/2");
  }
}

TEST(BootstrapTest, CallbackResultIsChecked) {
  auto short_result = MakeCallbackBootstrap(
      0, 2, [](const std::string& b) { return absl::StatusOr<std::vector<std::string>>(std::vector<std::string>{b}); });
  EXPECT_EQ(short_result->AllGather("x").status().code(), absl::StatusCode::kInternal);
  auto ok = MakeCallbackBootstrap(1, 2, [](const std::string& b) {
    return absl::StatusOr<std::vector<std::string>>(std::vector<std::string>{"other", b});
  });
  auto all = ok->AllGather("mine");
  ASSERT_TRUE(all.ok());
  EXPECT_EQ((*all)[1], "mine");
  auto failing = MakeCallbackBootstrap(0, 1, [](const std::string&) {
    return absl::StatusOr<std::vector<std::string>>(absl::UnavailableError("group gone"));
  });
  EXPECT_EQ(failing->Barrier().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace llep
