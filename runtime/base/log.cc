#include "runtime/base/log.h"

#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace llep::base {
namespace {

int ConfiguredLevel() {
  static const int level = [] {
    const char* env = std::getenv("LLEP_LOG_LEVEL");
    return env != nullptr ? std::atoi(env) : static_cast<int>(LogLevel::kWarning);
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
