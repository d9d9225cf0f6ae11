// Minimal leveled logging to stderr (abseil 20220623 has no absl/log). Layer: runtime/base.
// LLEP_LOG_LEVEL=0..3 (error, warning, info, debug) selects what is printed; default 1 (warnings).
#pragma once

#include <sstream>
#include <string>

namespace llep::base {

enum class LogLevel { kError = 0, kWarning = 1, kInfo = 2, kDebug = 3 };

bool LogEnabled(LogLevel level);

/// Accumulates one line and writes it atomically (one write(2)) on destruction.
class LogLine {
 public:
  LogLine(LogLevel level, const char* file, int line);
  ~LogLine();
  template <typename T>
  LogLine& operator<<(const T& v) {
    stream_ << v;
    return *this;
  }

 private:
  std::ostringstream stream_;
};

}  // namespace llep::base

#define LLEP_LOG(level)                                           \
  if (!::llep::base::LogEnabled(::llep::base::LogLevel::level)) { \
  } else                                                          \
    ::llep::base::LogLine(::llep::base::LogLevel::level, __FILE__, __LINE__)
