#include "runtime/base/env.h"

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace llep::base {

std::string EnvString(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' ? std::string(v) : fallback;
}

absl::StatusOr<int> EnvInt(const char* name, int fallback) {
  const std::string v = EnvString(name);
  if (v.empty()) return fallback;
  int n = 0;
  if (!absl::SimpleAtoi(v, &n)) {
    return absl::InvalidArgumentError(absl::StrCat(name, "='", v, "': expected an integer"));
  }
  return n;
}

}  // namespace llep::base
