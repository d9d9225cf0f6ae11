#include "runtime/base/env.h"

#include <gtest/gtest.h>

#include <cstdlib>

namespace llep::base {
namespace {

TEST(EnvTest, UnsetOrEmptyGivesTheDefaultAndGarbageAnError) {
  unsetenv("LLEP_TEST_ENV");
  EXPECT_EQ(EnvString("LLEP_TEST_ENV", "d"), "d");
  EXPECT_EQ(*EnvInt("LLEP_TEST_ENV", 7), 7);
  setenv("LLEP_TEST_ENV", "", 1);
  EXPECT_EQ(EnvString("LLEP_TEST_ENV", "d"), "d");
  EXPECT_EQ(*EnvInt("LLEP_TEST_ENV", 7), 7);
  setenv("LLEP_TEST_ENV", "-3", 1);
  EXPECT_EQ(EnvString("LLEP_TEST_ENV"), "-3");
  EXPECT_EQ(*EnvInt("LLEP_TEST_ENV", 7), -3);
  setenv("LLEP_TEST_ENV", "3x", 1);
  const auto bad = EnvInt("LLEP_TEST_ENV", 7);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bad.status().message()).find("LLEP_TEST_ENV"), std::string::npos);
  unsetenv("LLEP_TEST_ENV");
}

}  // namespace
}  // namespace llep::base
