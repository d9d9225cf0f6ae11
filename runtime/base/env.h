// Environment parameters (LLEP_*), read one way everywhere: unset or empty means "use the default", anything else
// must parse, so a typo becomes an error naming the variable instead of a silently ignored setting. Layer:
// runtime/base.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace llep::base {

/// The variable's value, or `fallback` when it is unset or empty.
std::string EnvString(const char* name, const std::string& fallback = "");

/// The variable as an integer, `fallback` when unset or empty; InvalidArgument naming it when it is not an integer.
absl::StatusOr<int> EnvInt(const char* name, int fallback);

}  // namespace llep::base
