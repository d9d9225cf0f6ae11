#include "runtime/base/log.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "runtime/base/env.h"

namespace llep::base {
namespace {

int ConfiguredLevel() {
  static const int level = [] {
    const absl::StatusOr<Options> env = ReadOptions();  // a malformed option is reported where it is used
    return env.ok() ? env->log_level : static_cast<int>(LogLevel::kWarning);
  }();
  return level;
}

const char* LevelTag(LogLevel level) {
  switch (level) {
    case LogLevel::kError:
      return "E";
    case LogLevel::kWarning:
      return "W";
    case LogLevel::kInfo:
      return "I";
    case LogLevel::kDebug:
      return "D";
  }
  return "?";
}

}  // namespace

bool LogEnabled(LogLevel level) { return static_cast<int>(level) <= ConfiguredLevel(); }

LogLine::LogLine(LogLevel level, const char* file, int line) {
  const char* base = std::strrchr(file, '/');
  stream_ << "llep[" << LevelTag(level) << " pid " << getpid() << " " << (base ? base + 1 : file) << ":" << line
          << "] ";
}

LogLine::~LogLine() {
  stream_ << '\n';
  const std::string s = stream_.str();
  // One write keeps lines from concurrent rank processes intact.
  ssize_t ignored = write(STDERR_FILENO, s.data(), s.size());
  (void)ignored;
}

}  // namespace llep::base
