#include "runtime/base/env.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

namespace llep::base {
namespace {

class EnvTest : public ::testing::Test {
 protected:
  void SetUp() override { ClearAll(); }
  void TearDown() override { ClearAll(); }
  static void ClearAll() {
    for (const char* name : kOptionNames) unsetenv(name);
  }
};

TEST_F(EnvTest, UnsetOrEmptyGivesTheDocumentedDefaults) {
  setenv("LLEP_NUM_CTAS", "", 1);  // empty = unset
  const absl::StatusOr<Options> o = ReadOptions();
  ASSERT_TRUE(o.ok()) << o.status();
  const Options d;
  EXPECT_EQ(o->backend, "");
  EXPECT_EQ(o->fabric_provider, "");
  EXPECT_EQ(o->timeout, absl::Seconds(30));
  EXPECT_EQ(o->proxy_threads, 1);
  EXPECT_EQ(o->proxy_spin, 1 << 20);
  EXPECT_EQ(o->num_ctas, 0);
  EXPECT_TRUE(o->metrics);
  EXPECT_FALSE(o->kernel_trace);
  EXPECT_EQ(o->metrics_port, -1);
  EXPECT_EQ(o->metrics_addr, "127.0.0.1");
  EXPECT_EQ(o->metrics_interval_s, 1.0);
  EXPECT_EQ(o->ranks_per_node, 0);
  EXPECT_EQ(o->ib_gid_index, 0);
  EXPECT_EQ(o->log_level, 1);
  EXPECT_EQ(o->num_ctas, d.num_ctas);
}

TEST_F(EnvTest, ValuesParse) {
  setenv("LLEP_BACKEND", "cpu", 1);
  setenv("LLEP_FABRIC_PROVIDER", "tcp;ofi_rxm", 1);
  setenv("LLEP_TIMEOUT_S", "2.5", 1);
  setenv("LLEP_PROXY_THREADS", "3", 1);
  setenv("LLEP_METRICS", "0", 1);
  setenv("LLEP_KERNEL_TRACE", "1", 1);
  setenv("LLEP_METRICS_PORT", "9400", 1);
  setenv("LLEP_METRICS_LABELS", "model_name=m", 1);
  setenv("LLEP_RANKS_PER_NODE", "2", 1);
  const absl::StatusOr<Options> o = ReadOptions();
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->backend, "cpu");
  EXPECT_EQ(o->fabric_provider, "tcp;ofi_rxm");
  EXPECT_EQ(o->timeout, absl::Milliseconds(2500));
  EXPECT_EQ(o->proxy_threads, 3);
  EXPECT_FALSE(o->metrics);
  EXPECT_TRUE(o->kernel_trace);
  EXPECT_EQ(o->metrics_port, 9400);
  EXPECT_EQ(o->metrics_labels, "model_name=m");
  EXPECT_EQ(o->ranks_per_node, 2);
}

TEST_F(EnvTest, GarbageIsAnErrorNamingTheVariable) {
  for (const auto& [name, value] :
       std::vector<std::pair<const char*, const char*>>{{"LLEP_BACKEND", "gpu"},
                                                        {"LLEP_TIMEOUT_S", "0"},
                                                        {"LLEP_TIMEOUT_S", "3x"},
                                                        {"LLEP_PROXY_THREADS", "0"},
                                                        {"LLEP_NUM_CTAS", "-1"},
                                                        {"LLEP_METRICS", "yes"},
                                                        {"LLEP_RANKS_PER_NODE", "two"},
                                                        {"LLEP_RANKS_PER_NODE", "-1"},
                                                        {"LLEP_METRICS_INTERVAL_S", "-1"}}) {
    setenv(name, value, 1);
    const absl::StatusOr<Options> o = ReadOptions();
    ASSERT_FALSE(o.ok()) << name << "=" << value;
    EXPECT_EQ(o.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(o.status().message()).find(std::string(name) + "='" + value + "'"), std::string::npos)
        << o.status();
    unsetenv(name);
  }
}

}  // namespace
}  // namespace llep::base
