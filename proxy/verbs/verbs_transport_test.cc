// The verbs backend on a machine without an RDMA device (CI): creation must fail with a clear Unavailable error, not
// crash or hang, and the factory must route "ibverbs" to it. Where a device exists, the same tests check that a
// transport opens, registers memory and publishes a blob of the documented size.
#include "proxy/verbs/verbs_transport.h"

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <vector>

#include "proxy/transport_factory.h"

namespace llep::proxy {
namespace {

bool HaveRdmaDevice() {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list != nullptr) ibv_free_device_list(list);
  return list != nullptr && n > 0;
}

TEST(VerbsTransportTest, OpensOrExplainsWhyNot) {
  VerbsOptions o;
  o.rank = 0;
  o.num_ranks = 2;
  auto t = CreateVerbsTransport(o);
  if (!HaveRdmaDevice()) {
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_NE(std::string(t.status().message()).find("no RDMA devices"), std::string::npos) << t.status();
    return;
  }
  if (!t.ok()) GTEST_SKIP() << "device present but not usable here: " << t.status();
  std::vector<uint8_t> region(1 << 16);
  ASSERT_TRUE((*t)->RegisterRegion(region.data(), region.size()).ok());
  auto blob = (*t)->LocalBlob();
  ASSERT_TRUE(blob.ok());
  EXPECT_GT(blob->size(), 2 * sizeof(uint32_t));
}

TEST(VerbsTransportTest, RejectsBadOptions) {
  VerbsOptions o;
  o.rank = 2;
  o.num_ranks = 2;
  auto t = CreateVerbsTransport(o);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(VerbsTransportTest, FactoryRoutesNames) {
  auto v = CreateTransport(kIbverbsTransport, "", 0, 2);
  if (!HaveRdmaDevice()) EXPECT_EQ(v.status().code(), absl::StatusCode::kUnavailable);
  auto shm = CreateTransport("shm", "", 0, 2);
  ASSERT_TRUE(shm.ok()) << shm.status();
  EXPECT_NE((*shm)->Name().find("shm"), std::string::npos);
  auto bogus = CreateTransport("no-such-provider", "127.0.0.1", 0, 2);
  EXPECT_FALSE(bogus.ok());
}

}  // namespace
}  // namespace llep::proxy
