#include "runtime/topology.h"

#include <gtest/gtest.h>

#include <cstdlib>

namespace llep {
namespace {

using Paths = std::vector<std::vector<PeerPath>>;
std::vector<std::vector<bool>> AllReach(int R) { return std::vector<std::vector<bool>>(R, std::vector<bool>(R, true)); }

TEST(TopologyTest, OneHostIsAllNvlink) {
  auto p = DecidePeerPaths({"h", "h", "h", "h"}, AllReach(4), 0);
  ASSERT_TRUE(p.ok()) << p.status();
  for (int a = 0; a < 4; ++a) {
    for (int b = 0; b < 4; ++b) EXPECT_EQ((*p)[a][b], a == b ? PeerPath::kSelf : PeerPath::kNvlink);
  }
  EXPECT_FALSE(AnyProxyPath(*p));
}

TEST(TopologyTest, TwoHostsUseTheProxyBetweenThem) {
  auto p = DecidePeerPaths({"a", "a", "b", "b"}, AllReach(4), 0);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)[0][1], PeerPath::kNvlink);
  EXPECT_EQ((*p)[0][2], PeerPath::kProxy);
  EXPECT_EQ((*p)[3][1], PeerPath::kProxy);
  EXPECT_EQ((*p)[2][3], PeerPath::kNvlink);
  EXPECT_TRUE(AnyProxyPath(*p));
}

TEST(TopologyTest, VirtualNodesSplitOneHost) {
  auto p = DecidePeerPaths({"h", "h", "h", "h"}, AllReach(4), 2);
  ASSERT_TRUE(p.ok());
  const Paths want = {{PeerPath::kSelf, PeerPath::kNvlink, PeerPath::kProxy, PeerPath::kProxy},
                      {PeerPath::kNvlink, PeerPath::kSelf, PeerPath::kProxy, PeerPath::kProxy},
                      {PeerPath::kProxy, PeerPath::kProxy, PeerPath::kSelf, PeerPath::kNvlink},
                      {PeerPath::kProxy, PeerPath::kProxy, PeerPath::kNvlink, PeerPath::kSelf}};
  EXPECT_EQ(*p, want);
  auto all_proxy = DecidePeerPaths({"h", "h", "h"}, AllReach(3), 1);
  ASSERT_TRUE(all_proxy.ok());
  EXPECT_EQ((*all_proxy)[0][1], PeerPath::kProxy);
  EXPECT_EQ((*all_proxy)[1][1], PeerPath::kSelf);
  // A split never joins different hosts.
  auto hosts = DecidePeerPaths({"a", "b"}, AllReach(2), 2);
  ASSERT_TRUE(hosts.ok());
  EXPECT_EQ((*hosts)[0][1], PeerPath::kProxy);
}

TEST(TopologyTest, OneSidedPeerAccessFallsBackToTheProxyOnBothSides) {
  auto reach = AllReach(3);
  reach[0][2] = false;  // rank 0 cannot map rank 2; rank 2 could map rank 0
  auto p = DecidePeerPaths({"h", "h", "h"}, reach, 0);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)[0][2], PeerPath::kProxy);
  EXPECT_EQ((*p)[2][0], PeerPath::kProxy);  // symmetric: both sides agree where signals land
  EXPECT_EQ((*p)[1][2], PeerPath::kNvlink);
}

TEST(TopologyTest, RejectsBadInput) {
  EXPECT_EQ(DecidePeerPaths({"h", "h"}, AllReach(3), 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecidePeerPaths({"h", "h"}, {{true, true}, {true}}, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecidePeerPaths({"h"}, AllReach(1), -1).status().code(), absl::StatusCode::kInvalidArgument);
}

// LLEP_RANKS_PER_NODE is read with every option (runtime/base/env_test.cc: default 0, "2", "two" and "-1" refused).
TEST(TopologyTest, HostIdentityNamesHostAndBoot) { EXPECT_NE(HostIdentity().find('/'), std::string::npos); }

}  // namespace
}  // namespace llep
